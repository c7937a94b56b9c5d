"""The predictor's inputs read from a run, its table, its sentences and its refusals (stnb.scaling), in one
process. The runs are made of simulated DDP steps (tests/simsteps.py: StepTimer's real summary of steps whose
forward, backward, buckets and optimizer took known simulated seconds), so what the predictor must take from
them is known from the timeline, not typed: the measured phases are used where measured, the assumption labels
say which, and the table's numbers keep the relations a user reads them by."""

import statistics
from dataclasses import replace

import pytest

from simsteps import CLIP, FETCH, FORWARD, GRAD_STEP, OPT_STEP, REST, TAIL, ddp_rank_summary
from stnb.errors import ConfigError
from stnb.scaling import (Measured, Range, compare, from_result, known, predict, uncertain_from_result,
                          verdict)
from stnb.scaling import _check_devices, _check_strategies, assumptions
from stnb.scaling.inputs import text_columns
from stnb.scaling.links import PRESETS, Fabric, custom
from stnb.strategies.stepcost import slowest_of

BATCH, ACCUMULATION, WARM, STEPS = 8, 2, 2, 6
PARAMS, TRAINABLE = 60, 56  # tests/simsteps.py's Net: 60 parameters (its head's 4 frozen here, say)


def run(strategy="ddp", world=2, calls=2, config=None, pace=1.0, **over):
    """A run of STEPS simulated DDP steps per rank; its WARM warm-up steps take ``pace`` times as long."""
    splits = [ddp_rank_summary(STEPS, calls=calls, slow_first=WARM, pace=pace) for _ in range(world)]
    step_times = [max(s["steps"][i]["step"] for s in splits) for i in range(STEPS)]
    r = {"status": "ok", "strategy": strategy, "world_size": world, "device": "cpu", "steps": STEPS,
         "per_device_batch_size": BATCH, "step_times": step_times, "time_split": splits,
         "samples_per_second": world * BATCH * ACCUMULATION / statistics.fmean(step_times[WARM:]),
         "config": {"warmup_steps_excluded": WARM, "gradient_accumulation_steps": ACCUMULATION, **(config or {})},
         "verification": {"model_shape": {"param_count": PARAMS, "trainable_param_count": TRAINABLE},
                          "data_columns": ["anchor", "positive"]}}
    r.update(over)
    return r


def said(m) -> dict:
    return {name: (how, what) for name, how, what in m.inputs}


def test_the_step_is_the_runs_measured_phases_and_the_inputs_say_measured():
    m = from_result(run())
    assert m.forward == pytest.approx(2 * FORWARD)  # the step's two model calls
    assert m.backward == pytest.approx(4 * GRAD_STEP)  # backward's compute: the exposed all-reduce left out
    assert m.optimizer == pytest.approx(CLIP + OPT_STEP) and m.other == pytest.approx(FETCH + REST)
    assert m.step == pytest.approx(2 * FORWARD + 4 * GRAD_STEP + CLIP + OPT_STEP + FETCH + REST)
    assert m.batch == BATCH * ACCUMULATION and m.forward_calls == 2
    assert m.grad_bytes == 4 * TRAINABLE and m.param_bytes == 4 * PARAMS and m.bucket_bytes == 25 * 2**20
    assert m.fits and m.gathers_again
    assert m.source == "ddp run on 2 cpu rank(s), means of 4 steady steps of its measured time split"
    inputs = said(m)
    assert inputs["forward, backward compute, data + rest"] == ("measured", "the time split's phases")
    assert inputs["optimizer"] == ("measured", f"optimizer.step {OPT_STEP * 1e3:.2f} ms + clipping {CLIP * 1e3:.2f} "
                                               "ms, between the trainer's callbacks")
    assert inputs["model calls per step"] == ("measured", "2 forward(s) of the module that trains")
    assert inputs["host vs device"] == ("assumed", "the same clock (CPU): host work is the step")
    assert inputs["link bandwidth and per-collective cost"] == (
        "assumed", "the link preset's range (or this machine's loopback, measured by a sweep)")
    assert inputs["every added device computes as fast"] == ("assumed", "")
    assert inputs["data loading"][0] == "measured"
    assert inputs["FSDP's host work per collective"] == (
        "assumed", "0: give a one-rank FSDP run (one_rank=) to measure it")
    assert list(inputs)[-3:] == ["link bandwidth and per-collective cost", "FSDP's host work per collective",
                                 "every added device computes as fast"]
    assert "the compute was measured in a 2-rank ddp run, not on one device" in m.notes
    assert [n for n in m.notes if "sharded" in n] == []


def test_gradient_readiness_is_the_measured_order_with_each_groups_share():
    m = from_result(run())
    backward = 4 * GRAD_STEP + TAIL
    # tests/simsteps.py: the head (4 of 60 elements) ready first, then layer 1, layer 0, the embeddings
    want = [(GRAD_STEP / backward, 4 / 60), (2 * GRAD_STEP / backward, 20 / 60), (3 * GRAD_STEP / backward, 20 / 60),
            (4 * GRAD_STEP / backward, 16 / 60)]
    assert [x for pair in m.ready for x in pair] == pytest.approx([x for pair in want for x in pair])
    how, what = said(m)["gradient readiness (DDP's buckets)"]
    assert (how, what) == ("measured", "each group's last gradient, as a fraction of backward: other 0.18, layer 1 "
                                       "0.36, layer 0 0.55, embeddings 0.73")


def test_the_data_wait_and_the_host_clock_are_taken_where_measured():
    r = run()
    for split in r["time_split"]:
        for st in split["steps"]:
            st["data_wait"] = 0.02
            st["host"] = {"forward": 0.1, "backward": 0.2, "optimizer_step": 0.01, "step": 0.5}
    inputs = said(from_result(r))
    assert inputs["data loading"] == ("measured", "20.00 ms a step waiting for batches (inside the data part)")
    assert inputs["host vs device"] == ("measured", "host seconds beside the CUDA events")


def test_what_the_run_did_not_record_is_assumed_and_said_so():
    r = run(world=1)
    for split in r["time_split"]:
        split.pop("grad_groups")
        for st in split["steps"]:
            for k in ("forward_calls", "optimizer_step", "clip", "grad_ready", "data_wait"):
                st.pop(k)
    m = from_result(r)
    inputs = said(m)
    assert m.ready == () and inputs["gradient readiness (DDP's buckets)"] == (
        "assumed", "the layers' in proportion to backward, the root (25%) at its end")
    assert inputs["model calls per step"] == ("assumed", "one per text column of the data") and m.forward_calls == 2
    assert inputs["optimizer"] == ("measured", "backward's end to the optimizer step's end (an older stnb)")
    assert m.optimizer == pytest.approx(CLIP + OPT_STEP)
    assert "data loading" not in inputs
    assert not any("rank" in n and "measured in a" in n for n in m.notes)  # one rank: nothing to say
    assert (m.layers, m.root_fraction) == (12, 0.25)
    assert inputs["FSDP units"] == ("assumed", "12 layers + a root of 25% of the parameters")
    assert "FSDP units not recorded in this result: 12 layers + a root of 25% of the parameters assumed" in m.notes
    r["verification"]["data_columns"] = ["sentence1", "sentence2", "sentence3", "score"]
    assert from_result(r).forward_calls == 3  # one per text column, the label left out
    r["verification"].pop("data_columns")
    m = from_result(r)
    assert m.forward_calls == 2.0 and said(m)["model calls per step"] == ("assumed", "1 to 3")
    assert ("the run did not record its data's columns: the model calls per step (one per text column) taken as "
            "1 to 3") in m.notes
    unc = uncertain_from_result(r)
    calls = next(x for x in unc.ranges if x.name == "forward_calls")
    assert calls == Range("forward_calls", 1.0, 2.0, 3.0, "model calls per step", "not recorded by the run")
    assert unc.build({"spread": 0.0, "forward_calls": 3.0}).forward_calls == 3.0


def test_the_recorded_units_bucket_size_hook_and_resharding_are_the_runs():
    r = run(config={"bucket_cap_mb": 4, "comm_hook": "fp16", "reshard_after_forward": False})
    for split in r["time_split"]:
        split["units"] = {"layers": 2, "root_fraction": 0.3}
    m = from_result(r)
    assert (m.layers, m.root_fraction) == (2, 0.3) and "FSDP units" not in said(m)
    assert m.bucket_bytes == 4 * 2**20 and m.grad_bytes == 2 * TRAINABLE and not m.gathers_again
    assert from_result(run(config={"comm_hook": "bf16"})).grad_bytes == 2 * TRAINABLE
    assert from_result(run(config={"comm_hook": "embedding_rows"})).grad_bytes == 4 * TRAINABLE
    r["verification"]["model_shape"].pop("trainable_param_count")
    assert from_result(r).grad_bytes == 2 * PARAMS


def test_fsdp_gathers_parameters_in_the_training_precision_and_reduces_fp32():
    """Issue 31 item 2, the dtype sent: stnb's FSDP (MixedPrecisionPolicy) gathers parameters in bf16 / fp16 on GPUs
    and reduce-scatters fp32 gradients; DDP's gradients are the fp32 parameters' (2 B only with a hook); DP and ZeRO-1
    move fp32 parameters. A bf16 GPU run's FSDP row gathers half the bytes, the other rows move the same. On CPU
    FSDP gathers fp32 whatever the flag (issue 49 item 3: the trainer's autocast only, as under single)."""
    fp32, bf16 = from_result(run()), from_result(run(config={"mixed_precision": "bf16"}, device="cuda"))
    assert (fp32.gather_bytes, bf16.gather_bytes) == (4 * PARAMS, 2 * PARAMS)
    assert from_result(run(config={"mixed_precision": "bf16"})).gather_bytes == 4 * PARAMS  # a CPU run
    assert fp32.param_bytes == bf16.param_bytes == 4 * PARAMS and fp32.grad_bytes == bf16.grad_bytes == 4 * TRAINABLE
    assert said(bf16)["bytes on the wire"] == ("from the run's settings", "gradients 4 B each (fp32), FSDP's "
                                               "gathered parameters 2 B each (bf16 param_dtype), its reduce-scatters fp32")
    assert said(fp32)["bytes on the wire"][1] == ("gradients 4 B each (fp32), FSDP's gathered parameters 4 B each "
                                                  "(fp32), its reduce-scatters fp32")
    assert said(from_result(run(config={"mixed_precision": "fp16", "comm_hook": "fp16"}, device="cuda")))[
            "bytes on the wire"][1] == (
        "gradients 2 B each (the fp16 hook), FSDP's gathered parameters 2 B each (fp16 param_dtype), its "
        "reduce-scatters fp32")
    # the same measured step, a slow link (communication dominates): FSDP gathers in half the time, DDP the same
    big = replace(fp32, grad_bytes=4e8, param_bytes=4e8, gather_bytes=4e8)
    link = Fabric(custom("slow", 1, 10, per_node=8), PRESETS["100gbps"])
    from stnb import strategies

    fsdp, ddp = strategies.get("fsdp"), strategies.get("ddp")
    assert fsdp.step_time(replace(big, gather_bytes=2e8), link, 4)["step"] < fsdp.step_time(big, link, 4)["step"]
    assert ddp.step_time(replace(big, gather_bytes=2e8), link, 4) == ddp.step_time(big, link, 4)
    assert fsdp.step_time(replace(big, gather_bytes=None), link, 4) == fsdp.step_time(big, link, 4)  # None: fp32


def test_a_sharded_run_does_not_fit_and_its_note_says_the_prediction_is_low():
    m = from_result(run("fsdp"))
    assert not m.fits
    assert ("the run is sharded (FSDP): its backward includes its all-gathers and reduce-scatters (stnb times only "
            "the forward all-gathers), so the prediction counts those twice and is low") in m.notes


def test_the_step_spread_is_the_ranks_own_else_the_runs_steps():
    spread = {"std": 0.018, "p50": 1.2, "p90": 1.25, "mean": 1.21, "steps": 4}
    work = {"evaluate": {"calls": 2, "seconds": [0.5, 0.7], "every_steps": 2, "after_steps": [2, 4]},
            "save": {"calls": 1, "seconds": [0.3], "every_steps": None, "after_steps": [3]}}
    r = run(outside_steps=[{"spread": spread, "work": work}, {"spread": dict(spread, std=0.022), "work": {}}])
    m = from_result(r)
    assert m.step_spread == pytest.approx(0.02)  # the ranks' mean
    inputs = said(m)
    assert inputs["step spread"] == ("measured", "std of each rank's own steady steps, 20.00 ms (p50 1200.0, p90 1250.0 ms)")
    # an evaluation is timed apart (the step clock resumes after it); a save lands in the next step
    assert inputs["evaluate between steps"] == ("measured",
                                                "2 call(s), 0.60 s each, outside the step times (timed apart)")
    assert inputs["save between steps"] == ("measured", "1 call(s), 0.30 s each, in the data part of the next "
                                                        "step: per device, not divided by the devices")
    r = run(step_times=[9.0, 9.0, 1.0, 1.2, 1.4, 1.0])
    m = from_result(r)
    assert m.step_spread == pytest.approx(statistics.pstdev([1.0, 1.2, 1.4, 1.0]))
    assert said(m)["step spread"] == ("measured", "std of the run's steady steps (the slowest rank's per step)")
    two = run(step_times=[9.0, 9.0, 1.0, 1.2])
    assert from_result(two).step_spread == pytest.approx(0.1)  # two steady steps are a spread already
    one = run(step_times=[9.0, 9.0, 1.0])
    none = run()
    none.pop("step_times")
    assert from_result(one).step_spread == 0.0 and from_result(none).step_spread == 0.0  # nothing to spread
    unc = uncertain_from_result(r)
    (rng,) = unc.ranges  # the run counted its model calls: only the spread is open
    assert rng == Range("spread", 0.0, m.step_spread / 2, m.step_spread, "a rank's step spread (s)",
                        "0: ranks identical; the run's measured standard deviation of its steady steps")
    assert unc.build({"spread": 0.001}).step_spread == 0.001
    assert unc.mid().step_spread == pytest.approx(m.step_spread / 2)


def test_a_result_without_a_time_split_is_split_one_to_two():
    r = run(world=1, step_times=[5.0, 5.0, 0.9, 1.2, 0.9, 1.2])
    r.pop("time_split")
    m = from_result(r)
    assert m.forward == pytest.approx(1.05 / 3) and m.backward == pytest.approx(2 * 1.05 / 3)
    assert m.optimizer == 0.0 and m.other == 0.0
    assert m.source == "ddp run, median step 1050.0 ms (no time split in this result)"
    assert said(m)["forward, backward, optimizer"] == ("assumed", "1:2 of the step, optimizer inside them")
    assert m.notes == ("no time split in this result: forward:backward taken as 1:2 (their FLOPs), optimizer and "
                       "data inside them", "FSDP units not recorded in this result: 12 layers + a root of 25% of the "
                       "parameters assumed")
    r.pop("world_size")  # one rank unless the run says otherwise
    assert not any("measured in a" in n for n in from_result(r).notes)


@pytest.mark.parametrize("change,words", [
    ({"status": "failed", "reason": "out of memory"}, "cannot predict from a run that did not train (failed: out of "
                                                      "memory); give a run that finished"),
    ({"samples_per_second": 0}, "cannot predict from a run that did not train (ok: None)"),
    ({"samples_per_second": None}, "cannot predict from a run that did not train"),
    ({"steps": WARM + 2}, "this run has 2 steady step(s) after its 2 warm-up step(s); the prediction needs at "
                          "least 3: run at least 5 steps"),
    ({"steps": 1}, "this run has 0 steady step(s)"),
    ({"verification": {}}, "this run has no model shape (verification['model_shape']); run it again with stnb"),
    ({"verification": {"model_shape": {"param_count": 0}}}, "this run has no model shape"),
])
def test_a_run_the_predictor_cannot_use_is_refused_with_the_reason(change, words):
    with pytest.raises(ConfigError) as e:
        from_result(run(**change))
    assert str(e.value).startswith(words)


def test_three_steady_steps_are_enough_and_the_warmup_is_the_runs():
    assert from_result(run(steps=WARM + 3)).forward == pytest.approx(2 * FORWARD)
    r = run(config={"warmup_steps_excluded": 0})
    r["config"].pop("gradient_accumulation_steps")
    m = from_result(r)
    assert m.batch == BATCH and "means of 6 steady steps" in m.source
    r["config"].pop("warmup_steps_excluded")  # the default: 2
    assert "means of 4 steady steps" in from_result(r).source


def test_slower_warmup_steps_are_left_out_of_the_step_and_the_prediction():
    """A real run's first steps are slower (allocations, caches, the first collectives); the steps the run
    excluded as warm-up are left out of every measured phase, of the spread and so of the prediction, which
    equal those of a run whose every step took the steady time. Without a time split, the step is the steady
    steps' mean."""
    slow, even = run(pace=5.0), run()
    assert slow["step_times"][0] == pytest.approx(5 * slow["step_times"][-1])  # the warm-up really is slower
    assert slow["step_times"][WARM:] == pytest.approx(even["step_times"][WARM:])
    m = from_result(slow)
    assert m.forward == pytest.approx(2 * FORWARD) and m.backward == pytest.approx(4 * GRAD_STEP)
    assert m.optimizer == pytest.approx(CLIP + OPT_STEP) and m.other == pytest.approx(FETCH + REST)
    assert m.step_spread == pytest.approx(0.0, abs=1e-9)
    assert m.step == pytest.approx(from_result(even).step)
    for strategy, n in (("single", 1), ("ddp", 2), ("ddp", 8)):
        got = predict(slow, devices=[2, 8], link="pcie4").row(strategy, n)["samples_per_second"]
        assert got == pytest.approx(predict(even, devices=[2, 8], link="pcie4").row(strategy, n)["samples_per_second"])
    slow.pop("time_split")
    assert from_result(slow).forward == pytest.approx(statistics.fmean(even["step_times"][WARM:]) / 3)


def test_text_columns_are_the_model_calls_a_step_makes():
    assert text_columns(["anchor", "positive", "negative"]) == 3
    assert text_columns(("sentence1", "sentence2", "label")) == 2
    assert text_columns(["score"]) == 1  # at least one call
    assert text_columns({"a": ["anchor", "positive"], "b": ["anchor", "positive", "negative"]}) == 2.5
    assert text_columns({"a": ["anchor"], "b": None}) is None and text_columns({}) is None
    assert text_columns(None) is None and text_columns("anchor") is None


# ---- the table ---------------------------------------------------------------------------------

def test_the_table_keeps_the_relations_a_user_reads_it_by():
    r = run()
    pred = predict(r, devices=[4, 2, 4], link="pcie4", strategies=["ddp", "single"])
    t = pred.table
    assert list(zip(t["strategy"], t["devices"])) == [("ddp", 2), ("ddp", 4), ("single", 1)]
    m = pred.measured
    single = pred.row("single", 1)
    assert single["speedup"] == pytest.approx(1.0) and single["efficiency"] == pytest.approx(1.0)
    assert single["samples_per_second"] == pytest.approx(m.batch / (m.step_spread / 2 * 0 + m.step))
    for n in (2, 4):
        row = pred.row("ddp", n)
        sps = row["samples_per_second"]
        assert sps == pytest.approx(n * m.batch / (row["step_ms"] / 1e3))  # n devices' samples per step
        assert row["speedup"] == pytest.approx(sps / single["samples_per_second"])
        assert row["efficiency"] == pytest.approx(row["speedup"] / n)
        assert row["low"] <= sps <= row["high"] and row["low"] < row["high"]
        assert row["link"] == "pcie4" and row["suspect"] == "" and row["note"] == ""
        assert 0 <= row["comm_exposed_ms"] <= row["comm_ms"] and row["comm_ms"] > 0
    assert pred.row("ddp", 4)["samples_per_second"] > pred.row("ddp", 2)["samples_per_second"]
    with pytest.raises(KeyError, match="no prediction for 'ddp' on 8 devices"):
        pred.row("ddp", 8)
    slow = predict(r, devices=[4], link=custom("slow", 1, latency_us=5000, overlap=False), strategies=["ddp"]).row("ddp", 4)
    assert slow["samples_per_second"] < pred.row("ddp", 4)["samples_per_second"]


def test_the_measured_spread_is_a_range_and_the_slowest_of_n_sets_the_pace():
    spread = {"std": 0.05, "p50": 1.0, "p90": 1.1, "mean": 1.0, "steps": 4}
    r = run(outside_steps=[{"spread": spread, "work": {}}] * 2)
    row = predict(r, devices=[8], link=custom("fixed", 10, 5), strategies=["ddp"]).row("ddp", 8)
    calm = predict(run(), devices=[8], link=custom("fixed", 10, 5), strategies=["ddp"]).row("ddp", 8)
    assert row["step_ms"] - calm["step_ms"] == pytest.approx(1e3 * 0.025 * slowest_of(8))  # at the mid: half the std
    assert row["dominant"] == "a rank's step spread (s)"
    assert row["low"] < row["samples_per_second"] < row["high"]
    assert row["high"] == pytest.approx(calm["samples_per_second"])  # ranks identical: the spread's low end


def test_the_assumptions_state_the_numbers_the_prediction_used():
    r = run()
    pred = predict(r, devices=[2], link="pcie4", strategies=["ddp", "dp"], host_fraction=(0.1, 0.3, 0.5))
    m = pred.measured
    first = pred.assumptions[0]
    assert first.startswith(f"one device's step ({m.source}), at the mids: forward {m.forward * 1e3:.1f} ms "
                            f"({m.forward_calls:g} call(s) of the model), backward {m.backward * 1e3:.1f} ms, "
                            f"optimizer {m.optimizer * 1e3:.1f} ms, rest {m.other * 1e3:.1f} ms for {m.batch} samples")
    text = "\n".join(pred.assumptions)
    assert f"link inside a node: {PRESETS['pcie4'].describe()}" in text
    assert f"between nodes (8 devices per node): {PRESETS['100gbps'].describe()}" in text
    assert "DataParallel: host busy 30% of a step at the mid" in text
    assert "range: DataParallel's host share: 0.1 / 0.3 / 0.5 (low / mid / high) (given)" in text
    assert "the measured gradient group filling it" in text and "communication overlaps compute" in text
    for name, how, what in m.inputs:
        assert f"{how.upper()}: {name}" + (f" ({what})" if what else "") in pred.assumptions
    assert pred.assumptions[-len(m.notes):] == list(m.notes)
    dp = pred.row("dp", 2)
    assert dp["low"] < dp["samples_per_second"] < dp["high"] and dp["dominant"] == "DataParallel's host share"
    assert pred.extra["inputs"] == ["spread", "host_fraction", "bandwidth", "launch"]


def test_the_assumptions_for_a_cpu_link_and_no_host_share():
    small = Measured(batch=4, forward=0.1, backward=0.2, optimizer=0.25, other=0.5, grad_bytes=8e6, param_bytes=8e6,
                     source="given")
    net = Fabric(custom("cpu", 1, 50, overlap=False, per_node=None), PRESETS["100gbps"])
    lines = assumptions(small, net)
    text = "\n".join(lines)
    assert lines[0] == ("one device's step (given), at the mids: forward 100.0 ms (1 call(s) of the model), backward "
                        "200.0 ms, optimizer 250.0 ms, rest 500.0 ms for 4 samples; every added device computes as fast")
    assert lines[2] == "the link is a network: any number of devices, one per node"
    assert lines[4] == ("communication counts in full (CPU: gloo's thread reduces on the cores the ranks compute on, "
                        "so what overlaps slows compute as much)")
    ready = assumptions(replace(small, ready=((0.5, 1.0),)), net)[3]
    assert "MiB buckets (each ready when the measured gradient group filling it was), parameters" in ready
    assert "DataParallel: the GIL's serialisation of the replicas is left out (host_fraction=None)" in text
    assert "the root's 25%, the embeddings, ready only at backward's end" in text
    assert "gradients 8 MiB in 25 MiB buckets" in text
    assert "parameters 8 MiB (FSDP gathers 8 MiB); FSDP units: 12 layers + the root" in text
    half = "\n".join(assumptions(replace(small, gather_bytes=4e6), net))
    assert "parameters 8 MiB (FSDP gathers 4 MiB); FSDP units" in half
    assert "DataParallel: host busy 40% of a step" in "\n".join(assumptions(small, net, host_fraction=0.4))


def test_compare_is_the_rows_prediction_against_the_measured_run():
    pred = predict(run(), devices=[2, 4], link="pcie4", strategies=["ddp"])
    measured = {"strategy": "ddp", "world_size": "4", "samples_per_second": 100.0}
    out = compare(pred, measured)
    want = pred.row("ddp", 4)["samples_per_second"]
    assert out == {"strategy": "ddp", "devices": 4, "predicted": want, "measured": 100.0,
                   "error": pytest.approx(want / 100.0 - 1)}

    class Result:
        def to_dict(self):
            return dict(measured, world_size=2)

    assert compare(pred, Result())["predicted"] == pred.row("ddp", 2)["samples_per_second"]


def test_the_verdict_says_what_the_devices_give_and_what_holds_them_back():
    m = Measured(batch=16, forward=0.1, backward=0.2, optimizer=0.03, other=0.01, grad_bytes=90e6, param_bytes=90e6)
    fast = predict(None, devices=[2], link="nvlink-h100", measured=m, strategies=["ddp"])
    row = fast.row("ddp", 2)
    assert row["efficiency"] >= 0.85
    head = (f"DDP on 2 devices over nvlink-h100: {row['speedup']:.2f}x one device ({row['samples_per_second']:,.1f} "
            f"samples/s, efficiency {row['efficiency']:.2f}), ")
    share = row["comm_exposed_ms"] / row["step_ms"]
    assert verdict(fast) == head + f"so the extra devices pay off (exposed communication: {share:.0%} of each step)."
    slow = predict(None, devices=[4], link="25gbps", measured=replace(m, grad_bytes=1e9), strategies=["ddp"])
    row = slow.row("ddp", 4)
    assert row["efficiency"] < 0.85
    sentence = verdict(slow, "ddp", 4)
    assert sentence.startswith(f"DDP on 4 devices over 25gbps: {row['speedup']:.2f}x one device")
    assert sentence.endswith(f"held back by exposed communication ({row['comm_exposed_ms'] / row['step_ms']:.0%} of "
                             "each step): a faster link, a bigger batch per device or gradient accumulation (fewer "
                             "all-reduces per sample) would help.")
    dp = predict(None, devices=[64], link="nvlink-a100", measured=m, strategies=["dp"])
    assert verdict(dp, "dp", 64) == f"dp on 64 devices: not possible ({dp.row('dp', 64)['note']})."


def test_devices_and_strategies_are_checked_with_the_fix():
    assert _check_devices(3) == [3] and _check_devices([8, 2, 8, 4]) == [2, 4, 8]
    for bad in ([], [1, 4], [True, 4], [2.0], 0, ["2"]):
        with pytest.raises(ConfigError) as e:
            _check_devices(bad)
        assert str(e.value) == f"devices={bad if isinstance(bad, list) else [bad]!r}: give device counts of at " \
                               "least 2, e.g. [2, 4, 8]"
    assert _check_strategies(None) == known() and _check_strategies("ddp") == ("ddp",)
    assert _check_strategies(["zero3", "ddp"]) == ("zero3", "ddp")
    with pytest.raises(ConfigError) as e:
        _check_strategies([])
    msg = str(e.value)
    assert msg.startswith("no scaling model for strategy (none given); the predictor knows ")
    assert all(repr(s) in msg for s in known()) and "'zero3' (fsdp)" in msg
    with pytest.raises(ConfigError, match=r"no scaling model for strategy 'tp', 'deepspeed'; "):
        _check_strategies(["tp", "ddp", "deepspeed"])


def test_the_host_share_is_a_range_only_when_given_as_one():
    m = Measured(batch=16, forward=0.1, backward=0.2, optimizer=0.03, other=0.01, grad_bytes=90e6, param_bytes=90e6)
    one = predict(None, devices=[4], link=custom("fixed", 10, 5), measured=m, strategies=["dp"], host_fraction=0.3)
    assert one.extra["ranges"] == () and one.row("dp", 4)["low"] == one.row("dp", 4)["high"]
    ranged = predict(None, devices=[4], link=custom("fixed", 10, 5), measured=m, strategies=["dp"],
                     host_fraction=(0.2, 0.3, 0.4))
    (rng,) = ranged.extra["ranges"]
    assert rng == Range("host_fraction", 0.2, 0.3, 0.4, "DataParallel's host share", "given")
    assert ranged.row("dp", 4)["samples_per_second"] == pytest.approx(one.row("dp", 4)["samples_per_second"])
    assert ranged.row("dp", 4)["low"] < one.row("dp", 4)["samples_per_second"] < ranged.row("dp", 4)["high"]


# ---- the loopback link's fit, the links --------------------------------------------------------

def test_the_loopback_fit_recovers_a_link_over_any_number_of_ranks():
    from stnb.scaling.calibrate import fit

    alpha, bw = 40e-6, 3e9
    for n in (2, 4, 8):  # an all-reduce over n ranks: 2(n-1) ring steps and 2(n-1)/n of the bytes per link
        times = {s: 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw for s in (4096, 1 << 20, 32 << 20)}
        a, b = fit({"world_size": n, "seconds": times})
        assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)


def test_the_loopback_fit_weighs_every_size_by_its_own_time():
    """Weighted by 1/t^2 (relative errors count alike): the fit's residuals r satisfy the weighted normal
    equations sum(r / t^2) = 0 and sum(r x / t^2) = 0, on times that no line fits exactly."""
    from stnb.scaling.calibrate import SIZES, fit

    rough = (1.3, 0.8, 1.1, 0.95, 1.05)
    times = {s: (50e-6 * 2 + s / 2e9) * f for s, f in zip(SIZES, rough)}
    a, b = fit({"world_size": 2, "seconds": times})
    residuals = [(s, t, t - (2 * a + s / b)) for s, t in times.items()]
    scale = sum(1 / t for _, t, _ in residuals)
    assert sum(r / t ** 2 for _, t, r in residuals) / scale == pytest.approx(0, abs=1e-9)
    assert sum(r * s / t ** 2 for s, t, r in residuals) / sum(s / t for s, t, _ in residuals) == pytest.approx(0, abs=1e-9)
    assert a > 0


def test_a_link_is_its_fields():
    from stnb.scaling.links import Link

    link = custom("mine", 12, 3, per_node=4, bandwidth_range_gbs=(10, 14), launch_us=(1, 2, 3))
    d = link.to_dict()
    assert d["name"] == "mine" and d["bandwidth"] == 12e9 and d["per_node"] == 4
    assert Link(**d) == link


def test_a_preset_from_its_topology_fewest_links_at_the_lowest_efficiency_to_most_at_the_highest():
    from stnb.scaling.links import GB, US, effective

    link = effective("quad", (3, 4), 25, (0.7, 0.8, 0.9), 4, "a white paper")
    assert (link.bandwidth_range[0], link.bandwidth, link.bandwidth_range[1]) == pytest.approx(
        (3 * 25 * 0.7 * GB, 4 * 25 * 0.8 * GB, 4 * 25 * 0.9 * GB))
    assert link.name == "quad" and link.per_node == 4 and link.overlap and link.tiers == ()
    assert link.latency == pytest.approx(5 * US) and link.launch == pytest.approx((5 * US, 15 * US, 50 * US))
    assert link.source == ("a white paper; 3-4 link(s) x 25 GB/s, protocol efficiency 0.7-0.9 (mid 0.8); latency "
                           "and per-collective cost: orders of magnitude, not measured")
    one = effective("eth", (1, 1), 12.5, (0.6, 0.75, 0.85), None, "IEEE", latency_us=30, launch_us=(1, 2, 3),
                    overlap=False, tiers=((2, 1.0, 2.0, 3.0),))
    assert one.source.startswith("IEEE; 1 link(s) x 12.5 GB/s, protocol efficiency 0.6-0.85 (mid 0.75)")
    assert one.latency == pytest.approx(30 * US) and one.launch == pytest.approx((1 * US, 2 * US, 3 * US))
    assert not one.overlap and one.per_node is None and one.tiers == ((2, 1.0, 2.0, 3.0),)


def test_up_to_four_v100s_of_a_dgx1_are_one_quad():
    from stnb.scaling.links import _quad_tier

    quad = PRESETS["nvlink-v100-4"]
    assert _quad_tier() == pytest.approx((4, quad.bandwidth_range[0], quad.bandwidth, quad.bandwidth_range[1]))
    cube = PRESETS["nvlink-v100"]
    assert [cube.bus_bandwidth(n, e) for n in (2, 4) for e in ("low", "mid", "high")] == pytest.approx(
        [quad.bandwidth_range[0], quad.bandwidth, quad.bandwidth_range[1]] * 2)
    assert cube.bus_bandwidth(5) == cube.bandwidth and cube.bus_bandwidth(8, "low") == cube.bandwidth_range[0]


def test_a_users_own_link():
    from stnb.scaling.links import GB, US

    link = custom("lab", 7, 9)
    assert (link.name, link.bandwidth, link.latency, link.per_node) == ("lab", 7 * GB, 9 * US, 8)
    assert link.overlap and link.source == "given by the user" and link.bandwidth_range is None
    assert link.launch == (0.0, 0.0, 0.0)
    own = custom("lab", 7, 9, source="my sweep", per_node=None)
    assert own.source == "my sweep" and own.per_node is None


def test_a_range_needs_its_ends_in_order_and_describes_itself():
    with pytest.raises(ValueError) as e:
        Range("optimizer", 0.3, 0.2, 0.4)
    assert str(e.value) == "range optimizer: low <= mid <= high needed, got 0.3, 0.2, 0.4"
    r = Range("spread", 1e-5, 2e-5, 3e-5, "a rank's step spread (s)", "measured")
    assert r.describe() == "a rank's step spread (s): 1e-05 / 2e-05 / 3e-05 (low / mid / high) (measured)"
    assert Range("x", 2.5e-5, 2.5e-5, 2.5e-5).describe() == "x: 2.5e-05"
    assert r.describe("{:.1f}") == "a rank's step spread (s): 0.0 / 0.0 / 0.0 (low / mid / high) (measured)"


def test_the_interval_walks_every_input_that_has_a_width():
    from stnb.scaling import interval

    ranges = (Range("optimizer", 0.1, 0.2, 0.3, "optimizer share"), Range("spread", 0.0, 0.0, 0.0))
    fixed, ranged = custom("fixed", 10, 5), custom("r", 10, 5, bandwidth_range_gbs=(9, 11), launch_us=(1, 2, 3))
    net_fixed, net_ranged = custom("nf", 10, 5, per_node=None), PRESETS["100gbps"]
    assert interval.widths(ranges, Fabric(fixed, net_fixed)) == ["optimizer"]
    assert interval.widths(ranges, Fabric(ranged, net_fixed)) == ["optimizer", "bandwidth", "launch"]
    assert interval.widths((), Fabric(fixed, net_ranged)) == ["bandwidth", "launch"]  # beyond a node: the network's
    one_node = custom("one", 10, 5, per_node=None)
    assert interval.widths((), Fabric(one_node, net_ranged)) == []  # a network link: no second level
    assert interval.widths((), Fabric(PRESETS["nvlink-v100"].__class__(**{**PRESETS["nvlink-v100"].to_dict(),
                                      "bandwidth_range": None}), net_fixed)) == ["bandwidth", "launch"]  # its tiers
    assert interval.scenarios([]) == [{}, {}]
    two_costs = custom("two", 10, 5, launch_us=(1, 1, 3))  # a fixed cost known at two of its ends
    assert interval.widths((), Fabric(two_costs, net_fixed)) == ["launch"]
    net_two = custom("n2", 10, 5, per_node=None, launch_us=(2, 2, 9))
    assert interval.widths((), Fabric(fixed, net_two)) == ["launch"]
    assert interval.scenarios(["a", "b"]) == [{"a": "mid", "b": "mid"}, {"a": "low", "b": "low"},
                                              {"a": "low", "b": "high"}, {"a": "high", "b": "low"},
                                              {"a": "high", "b": "high"}]
    assert interval.one_at_a_time(["a", "b"]) == [("a", "low", {"a": "low", "b": "mid"}),
                                                  ("a", "high", {"a": "high", "b": "mid"}),
                                                  ("b", "low", {"a": "mid", "b": "low"}),
                                                  ("b", "high", {"a": "mid", "b": "high"})]
    assert interval.label("optimizer", ranges) == "optimizer share" and interval.label("spread", ranges) == "spread"
    assert interval.label("launch", ranges) == "per-collective fixed cost" and interval.label("other", ()) == "other"


def test_beyond_a_node_the_all_reduce_is_hierarchical():
    """Reduce-scatter inside each node, all-reduce of the node's sum between nodes (one card each), all-gather
    inside again: each a ring, each with its fixed cost."""
    from stnb.scaling.links import US

    inner = custom("in", 100, 2, per_node=8, launch_us=(1, 3, 5))
    outer = custom("out", 10, 20, per_node=None, launch_us=(10, 30, 50))
    fab = Fabric(inner, outer)
    s = 64e6

    def ring(lat, bw, n, passes):
        return passes * ((n - 1) * lat + (n - 1) / n * s / bw)

    # 32 devices: 4 nodes of 8
    want = 2 * 3 * US + 2 * ring(2 * US, 100e9, 8, 1) + 30 * US + ring(20 * US, 10e9, 4, 2)
    assert fab.all_reduce(s, 32) == pytest.approx(want)
    assert fab.all_reduce(s, 12) == pytest.approx(2 * 3 * US + 2 * ring(2 * US, 100e9, 8, 1) + 30 * US
                                                  + ring(20 * US, 10e9, 2, 2))  # 12 devices: 2 nodes
    assert fab.all_gather(s, 32) == pytest.approx(3 * US + ring(2 * US, 100e9, 8, 1) + 30 * US + ring(20 * US, 10e9, 4, 1))
    assert fab.all_reduce(s, 2) == pytest.approx(3 * US + ring(2 * US, 100e9, 2, 2))
    assert fab.broadcast(s, 2) == pytest.approx(3 * US + 2 * US + s / 100e9)
    assert fab.broadcast(s, 1) == fab.all_reduce(s, 1) == fab.all_gather(s, 1) == fab.reduce_scatter(s, 1) == 0.0
    one_per_node = Fabric(custom("nic", 100, 2, per_node=1, launch_us=(1, 3, 5)), outer)
    assert one_per_node.all_reduce(s, 4) == pytest.approx(2 * 3 * US + 30 * US + ring(20 * US, 10e9, 4, 2))


def test_suspects_leave_every_row_a_reason_or_nothing():
    from stnb.scaling import _model, interval

    rows = [{"strategy": "ddp", "devices": 2, "samples_per_second": None, "speedup": None},
            {"strategy": "single", "devices": 1, "samples_per_second": 10.0, "speedup": 1.0},
            {"strategy": "ddp", "devices": 2, "samples_per_second": 15.0, "speedup": 1.5}]
    interval.suspects(rows, _model)
    assert [r["suspect"] for r in rows] == ["", "", ""]


def _strategies(**kinds):
    """strategy_of for rows of made-up strategies: 'replicated' (distributed, nothing sharded) or 'sharded'."""
    from types import SimpleNamespace

    made = {"replicated": SimpleNamespace(distributed=True, sharded=frozenset()),
            "sharded": SimpleNamespace(distributed=True, sharded=frozenset({"params", "grads", "optimizer"}))}
    return lambda name: made[kinds[name]]


def test_a_sharding_strategy_is_compared_with_the_best_replicating_one():
    from stnb.scaling import interval

    of = _strategies(a="replicated", b="replicated", c="sharded")

    def row(s, sps, n=2):
        return {"strategy": s, "devices": n, "samples_per_second": sps, "speedup": 1.0}

    rows = [row("a", 20.0), row("b", 10.0), row("c", 15.0)]
    interval.suspects(rows, of)
    assert [r["suspect"] for r in rows] == ["", "", ""]  # behind the best (a), ahead of b only: fine
    rows = [row("a", 0.5), row("c", 0.8)]
    interval.suspects(rows, of)
    assert rows[1]["suspect"] == ("ahead of a (1 vs 0 samples/s) on a model that fits one device: it moves more "
                                  "bytes per step than a; only its sharded optimizer puts it ahead")
    rows = [row("a", 10.0), row("c", 10.0)]
    interval.suspects(rows, of)
    assert rows[1]["suspect"] == ""  # level with it: not ahead
    rows = [row("a", 10.0), row("b", 10.0), row("c", 12.0)]  # a tie: the first replicating one is named
    interval.suspects(rows, of)
    assert rows[2]["suspect"].startswith("ahead of a (12 vs 10 samples/s)")
    rows = [row("a", 10.0), dict(row("c", 12.0), fits=False), row("c", 12.0, n=4)]
    interval.suspects(rows, of)
    assert rows[1]["suspect"] == rows[2]["suspect"] == ""  # a model that does not fit; no replicating row on 4


def test_faster_than_linear_is_judged_at_the_mid_then_at_the_high_end():
    from stnb.scaling import interval

    of = _strategies(a="replicated")
    linear = 4 * (1 + 1e-9)
    rows = [{"strategy": "a", "devices": 4, "samples_per_second": 1.0, "speedup": linear, "speedup_high": linear},
            {"strategy": "a", "devices": 4, "samples_per_second": 1.0, "speedup": linear, "speedup_high": 4.5},
            {"strategy": "a", "devices": 4, "samples_per_second": 1.0, "speedup": 4.2, "speedup_high": 4.5},
            {"strategy": "a", "devices": 4, "samples_per_second": 1.0, "speedup": 3.0}]
    interval.suspects(rows, of)
    assert rows[0]["suspect"] == "" and rows[3]["suspect"] == ""  # at linear exactly: not faster
    assert rows[1]["suspect"] == ("faster than linear (4.50x on 4 devices at its high end): the model's per-device "
                                  "step is shorter than one device's, which only the optimizer stepping 1/n of the "
                                  "parameters gives; the single step's optimizer share decides it")
    assert rows[2]["suspect"].startswith("faster than linear (4.20x on 4 devices at its mid)")
    both = [{"strategy": "a", "devices": 2, "samples_per_second": 10.0, "speedup": 1.0},
            {"strategy": "c", "devices": 2, "samples_per_second": 30.0, "speedup": 3.0}]
    interval.suspects(both, _strategies(a="replicated", c="sharded"))
    first, second = both[1]["suspect"].split("; ahead of a")
    assert first.startswith("faster than linear (3.00x on 2 devices at its mid)") and second.startswith(" (30 vs 10")


def test_the_verdict_pays_off_from_an_efficiency_of_085():
    import pandas as pd

    from stnb.scaling import Prediction
    from stnb.scaling.links import fabric

    row = {"strategy": "ddp", "devices": 2, "samples_per_second": 17.0, "speedup": 1.7, "efficiency": 0.85,
           "comm_exposed_ms": 1.0, "step_ms": 10.0, "note": ""}
    pred = Prediction(pd.DataFrame([row]), [], None, fabric("pcie4"))
    assert verdict(pred).endswith("so the extra devices pay off (exposed communication: 10% of each step).")
    pred = Prediction(pd.DataFrame([dict(row, samples_per_second=None, note="too many")]), [], None, fabric("pcie4"))
    assert verdict(pred) == "ddp on 2 devices: not possible (too many)."


def test_a_result_object_its_dict_and_a_dict_without_status_are_read_alike():
    r = run()

    class Result:  # a RunResult: read through to_dict, not as a mapping
        def to_dict(self):
            return r

    assert from_result(Result()) == from_result(r)
    assert uncertain_from_result(Result()).mid() == uncertain_from_result(r).mid()
    no_status = dict(r)
    no_status.pop("status")  # a result written before stnb recorded it: it trained
    assert from_result(no_status).forward == pytest.approx(2 * FORWARD)
    no_steps = run(config={"warmup_steps_excluded": 0})
    no_steps.pop("steps")
    with pytest.raises(ConfigError, match=r"this run has 0 steady step\(s\) after its 0 warm-up step\(s\)"):
        from_result(no_steps)


def test_the_model_calls_are_a_range_only_when_neither_counted_nor_known_from_the_columns():
    r = run()
    for split in r["time_split"]:
        for st in split["steps"]:
            st.pop("forward_calls")
    assert [x.name for x in uncertain_from_result(r).ranges] == ["spread"]  # the data's two text columns
    r["verification"]["data_columns"] = None
    assert [x.name for x in uncertain_from_result(r).ranges] == ["spread", "forward_calls"]
    r["verification"] = None
    with pytest.raises(ConfigError):
        uncertain_from_result(r)  # no model shape either: refused


def test_a_link_describes_its_bandwidth_as_one_number_or_a_range():
    assert custom("mine", 12, 3, overlap=False).describe() == (
        "mine: bus bandwidth 12 GB/s per direction, latency 3 us per ring step, does not overlap compute "
        "(given by the user)")
    assert custom("r", 12, 3, bandwidth_range_gbs=(10, 14), launch_us=(1, 2, 3)).describe() == (
        "r: bus bandwidth 10 / 12 / 14 GB/s (low / mid / high) per direction, latency 3 us per ring step, per "
        "collective 1 / 2 / 3 us, overlaps compute (given by the user)")
    from stnb.scaling.links import GB, Link

    tiered = Link("t", 10 * GB, 1e-6, True, 8, "s", tiers=((4, 2 * GB, 3 * GB, 4 * GB), (2, 5 * GB, 6 * GB, 7 * GB)))
    assert tiered.describe() == ("t: bus bandwidth 10 GB/s per direction; up to 2 devices 5 / 6 / 7 GB/s; up to 4 "
                                 "devices 2 / 3 / 4 GB/s, latency 1 us per ring step, overlaps compute (s)")
    cube = PRESETS["nvlink-v100"].describe()
    assert "; up to 4 devices 52.5 / 80 / 90 GB/s, latency" in cube


def test_a_phase_measured_as_zero_is_zero():
    r = run()
    for split in r["time_split"]:
        for st in split["steps"]:
            st["other"] = 0.0
    assert from_result(r).other == pytest.approx(FETCH)  # the data part alone


def test_the_loopback_link_is_what_the_sweep_measured(monkeypatch):
    """'loopback' is this machine's link as calibrate.loopback measured it (2 gloo ranks, slow: the real sweep
    runs in test_scaling.py's measured two-rank test); here the sweep's result is given."""
    from stnb.scaling import calibrate
    from stnb.scaling.links import resolve

    monkeypatch.setattr(calibrate, "loopback", lambda: (3e-5, 2.5e9, "measured here: a sweep"))
    link = resolve("loopback")
    assert (link.name, link.bandwidth, link.latency, link.overlap, link.per_node, link.source) == (
        "loopback", 2.5e9, 3e-5, False, None, "measured here: a sweep")
    assert link.bandwidth_range is None and link.launch == (0.0, 0.0, 0.0)


def test_a_fabric_is_the_link_and_by_default_100gbps_between_nodes():
    from stnb.scaling.links import KNOWN, fabric, resolve

    fab = fabric("pcie4")
    assert fab.link is PRESETS["pcie4"] and fab.network is PRESETS["100gbps"]
    own = custom("n", 1, 1, per_node=None)
    assert fabric(own, own).network is own and resolve(own) is own
    with pytest.raises(ConfigError) as e:
        resolve("pcie9")
    assert str(e.value) == (f"unknown link 'pcie9'; choose one of {', '.join(map(repr, KNOWN))} (or pass a "
                            "stnb.scaling.Link)")


def test_an_unknown_link_is_refused_before_the_run_is_read_and_loopback_is_the_default(monkeypatch):
    from stnb.scaling import calibrate

    short = run(steps=WARM + 1)
    with pytest.raises(ConfigError) as e:
        predict(short, link="pcie9")  # both wrong: the link is named first, before the run is read
    assert str(e.value).startswith("unknown link 'pcie9'; choose one of ")
    monkeypatch.setattr(calibrate, "loopback", lambda: (3e-5, 2.5e9, "measured here: a sweep"))
    m = Measured(batch=16, forward=0.1, backward=0.2, optimizer=0.03, other=0.01, grad_bytes=90e6, param_bytes=90e6,
                 step_spread=0.02)
    pred = predict(None, measured=m, strategies=["ddp"])
    assert set(pred.table["link"]) == {"loopback"} and list(pred.table["devices"]) == [2, 4, 8]
    assert pred.assumptions[-1] == ("stragglers: every synchronised step waits for the slowest of n ranks, E[max of n "
                                    "normals] x a rank's step spread (20.00 ms at the mid)")


def test_the_network_between_nodes_is_the_one_asked_for():
    m = Measured(batch=16, forward=0.1, backward=0.2, optimizer=0.03, other=0.01, grad_bytes=90e6, param_bytes=90e6)
    slow, fast = (predict(None, devices=[16], link="nvlink-a100", network=net, measured=m, strategies=["ddp"])
                  for net in ("25gbps", "400gbps"))
    assert slow.row("ddp", 16)["samples_per_second"] < fast.row("ddp", 16)["samples_per_second"]
    assert f"between nodes (8 devices per node): {PRESETS['25gbps'].describe()}" in slow.assumptions
    exact = custom("in", 100, 5)  # no range anywhere: the prediction is a point
    net = custom("net", 10, 20, per_node=None)
    row = predict(None, devices=[16], link=exact, network=net, measured=m, strategies=["ddp"]).row("ddp", 16)
    assert row["low"] == row["samples_per_second"] == row["high"] and row["dominant"] == ""


def test_the_interval_takes_every_end_of_a_single_uncertain_input():
    m = Measured(batch=16, forward=0.1, backward=0.2, optimizer=0.03, other=0.01, grad_bytes=900e6, param_bytes=900e6)
    link = custom("r", 10, 5, per_node=None, overlap=False, bandwidth_range_gbs=(3, 30))  # its bandwidth alone
    pred = predict(None, devices=[4], link=link, measured=m, strategies=["ddp"])
    assert pred.extra["inputs"] == ["bandwidth"]
    row = pred.row("ddp", 4)
    assert row["low"] < row["samples_per_second"] < row["high"]
    none = predict(None, devices=[64], link="nvlink-a100", measured=m, strategies=["dp"]).table
    assert {"low", "high", "speedup", "efficiency"} <= set(none.columns) and none["low"].isna().all()


def test_the_refusal_lists_the_models_and_the_aliases_that_are_not_names():
    with pytest.raises(ConfigError) as e:
        _check_strategies(["x"])
    names = ", ".join(map(repr, known()))
    assert str(e.value) == f"no scaling model for strategy 'x'; the predictor knows {names} and 'zero3' (fsdp)"


def test_the_tables_columns_are_the_same_for_possible_and_impossible_rows():
    m = Measured(batch=16, forward=0.1, backward=0.2, optimizer=0.03, other=0.01, grad_bytes=90e6, param_bytes=90e6)
    cols = {"strategy", "devices", "link", "samples_per_second", "low", "high", "speedup", "efficiency", "step_ms",
            "comm_ms", "comm_exposed_ms", "dominant", "suspect", "note"}
    none = predict(None, devices=[64], link="nvlink-a100", measured=m, strategies=["dp"]).table
    assert set(none.columns) == cols and list(none["suspect"]) == [""]
    some = predict(None, devices=[2], link="nvlink-a100", measured=m, strategies=["ddp"]).table
    assert set(some.columns) == cols | {"speedup_high"}


# ---- CPU ranks sharing this machine's cores (the loopback link from a one-process CPU run) -------------------------

SHARED_HOW = "measured here: a probe"


@pytest.fixture
def probe(monkeypatch):
    """The loopback link and the cores' sharing as calibrate measured them (the real probe runs in test_scaling.py's
    slow test): every call to ``sharing`` is recorded, and it answers each n with ``probe.rows[n]``."""
    from stnb.scaling import calibrate

    import stnb.hardware

    calls, rows = [], {2: (1.2, 1.5, 1.9), 4: (2.0, 2.6, 3.1)}
    monkeypatch.setattr(stnb.hardware, "cpu_cores", lambda: 4)  # a 4-core machine

    def sharing(devices, alone, per_rank):
        calls.append((devices, alone, per_rank))
        return tuple((n, *rows[n]) for n in devices), SHARED_HOW

    monkeypatch.setattr(calibrate, "loopback", lambda: (3e-5, 2.5e9, "measured here: a sweep"))
    monkeypatch.setattr(calibrate, "sharing", sharing)
    return type("Probe", (), {"calls": calls, "rows": rows})


def one_process(threads=None, device="cpu"):
    return run(strategy="single", world=1, device=device, config={"threads_per_rank": threads} if threads else None)


def test_a_one_process_cpu_run_records_its_threads_and_a_run_of_ranks_or_on_a_gpu_does_not(probe):
    assert from_result(one_process(threads=3)).threads == 3
    assert from_result(one_process()).threads == 4  # stnb.run gives one process every core
    assert from_result(run()).threads == 0  # 2 ranks: their compute already shared the cores
    unsaid = one_process(threads=3)
    unsaid["world_size"] = None
    assert from_result(unsaid).threads == 3  # a result that does not say its ranks: one process
    assert from_result(one_process(threads=3, device="cuda")).threads == 0


def test_ranks_sharing_the_cores_compute_slower_by_what_the_probe_measured(probe):
    r = one_process(threads=1)
    pred = predict(r, devices=[2, 4, 8], link="loopback", strategies=["ddp"])
    assert probe.calls == [((2, 4), 1, (2, 1))]  # 4 cores: 2 ranks x 2 threads, 4 x 1; no more ranks than cores
    assert all(type(t) is int for t in probe.calls[0][2])  # whole threads: what a launch takes
    m = pred.measured
    for n, (lo, mid, hi) in [(2, probe.rows[2]), (4, probe.rows[4]), (8, probe.rows[4])]:  # 8: two full machines
        row = pred.row("ddp", n)
        alone = predict(r, devices=[n], link="pcie4", strategies=["ddp"])  # devices of their own: no probe
        own = predict(None, devices=[n], link=replace(pred.fabric.link, sharing=()), measured=m,
                      strategies=["ddp"]).row("ddp", n)  # the same link, each rank computing as fast as the run
        assert len(probe.calls) == 1 and alone.fabric.link.sharing == ()
        # on CPU every part of the step is the cores' work: the whole step grows by the factor, communication not
        assert row["step_ms"] - own["step_ms"] == pytest.approx((mid - 1) * m.step * 1e3)
        assert row["comm_ms"] == pytest.approx(own["comm_ms"])
        assert row["low"] < row["samples_per_second"] < row["high"]
        assert row["dominant"] == "CPU cores shared by the ranks"
    assert pred.extra["inputs"][-1] == "sharing"
    text = pred.assumptions
    assert text[0].endswith("; each of n ranks computes slower on this machine's shared cores (below)")
    assert ("CPU cores shared: a rank's compute x 1.20 / 1.50 / 1.90 on 2 ranks, 2.00 / 2.60 / 3.10 on 4 ranks, "
            "2.00 / 2.60 / 3.10 on 8 ranks (low / mid / high) against the run") in text
    assert (f"MEASURED: a rank's compute among n ranks on this machine's cores ({SHARED_HOW}; beyond 4 ranks: "
            "machines like this one, 4 ranks each (its 4-rank probe))") in text
    assert not any("every added device computes as fast" in line for line in text)
    assert "MEASURED: forward, backward compute, data + rest (the time split's phases)" in text  # the others stay
    full = predict(r, devices=[4], link="loopback", strategies=["ddp"]).fabric.link
    assert full.sharing_source == SHARED_HOW  # 4 ranks on 4 cores: no machine beyond this one


def test_the_interval_takes_the_probes_slowest_and_fastest_rank(probe):
    probe.rows[2] = (1.5, 1.5, 1.5)
    r = one_process(threads=2)
    flat = predict(r, devices=[2], link="loopback", strategies=["ddp"], threads_per_rank=3)
    assert probe.calls[-1] == ((2,), 2, (3,))  # the ranks' threads as asked
    assert flat.fabric.link.sharing_source == SHARED_HOW  # no machine beyond this one
    assert "sharing" not in flat.extra["inputs"]  # a probe whose ranks agree gives no width
    probe.rows[2] = (1.0, 1.5, 2.0)
    wide = predict(r, devices=[2], link="loopback", strategies=["ddp"], threads_per_rank=1).row("ddp", 2)
    mid = flat.row("ddp", 2)["samples_per_second"]
    assert wide["samples_per_second"] == pytest.approx(mid)
    m = flat.measured
    assert 2 * m.batch / wide["low"] - 2 * m.batch / mid == pytest.approx(0.5 * m.step, rel=1e-6)  # x2 against x1.5
    assert 2 * m.batch / mid - 2 * m.batch / wide["high"] == pytest.approx(0.5 * m.step, rel=1e-6)  # x1 against x1.5


def test_no_probe_for_devices_of_their_own_a_run_of_ranks_or_a_given_step(probe):
    predict(one_process(threads=1), devices=[2], link="pcie4", strategies=["ddp"])
    predict(run(), devices=[2], link="loopback", strategies=["ddp"])
    m = Measured(batch=16, forward=0.1, backward=0.2, optimizer=0.03, other=0.01, grad_bytes=9e6, param_bytes=9e6)
    predict(None, devices=[2], link="loopback", measured=m, strategies=["ddp"])
    assert probe.calls == []


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_threads_per_rank_is_a_whole_number_checked_before_anything_is_measured(probe, threads):
    with pytest.raises(ConfigError) as e:
        predict(one_process(threads=1), devices=[2], link="loopback", threads_per_rank=threads)
    assert str(e.value) == f"threads_per_rank must be a whole number >= 1 (got {threads!r})"
    assert probe.calls == []


def test_a_link_without_a_probe_for_n_computes_as_fast():
    link = replace(custom("x", 1, 1), sharing=((2, 1.1, 1.2, 1.3),))
    assert [link.compute_factor(2, end) for end in ("low", "mid", "high")] == [1.1, 1.2, 1.3]
    assert link.compute_factor(2) == 1.2  # the mid unless an end is asked for
    assert link.compute_factor(4) == 1.0 and custom("y", 1, 1).compute_factor(2) == 1.0
    fab = Fabric(link, PRESETS["100gbps"])
    assert fab.compute_factor(2) == 1.2 and fab.at(sharing="high").compute_factor(2) == 1.3


# ---- FSDP's host work per collective, from a one-rank FSDP run against the single run -------------------------------

def timed(strategy, steps, world=1, **over):
    """A one-process run whose steady steps took ``steps`` seconds (the warm-up's two first)."""
    times = [9.0, 9.0, *steps]
    return run(strategy=strategy, world=world, step_times=times, steps=len(times), **over)


def test_the_host_work_per_collective_is_the_one_rank_runs_extra_step_over_fsdps_collectives():
    from stnb.scaling import collective_host
    from stnb.strategies.fsdp import collectives_per_step

    single, one = timed("single", [1.0, 1.2, 1.1, 0.9]), timed("fsdp", [1.5, 1.7, 1.6, 1.4])
    r = collective_host(single, one)
    count = collectives_per_step(from_result(one), True)
    assert count == (12 + 1) * (2 + 2 + 1)  # 12 layers + the root (not recorded: assumed); 2 calls, resharded
    err = 2 * (2 * statistics.pstdev([1.0, 1.2, 1.1, 0.9]) ** 2 / 4) ** 0.5
    assert (r.low, r.mid, r.high) == pytest.approx(((0.5 - err) / count, 0.5 / count, (0.5 + err) / count))
    assert r.name == "collective_host" and r.label == "FSDP's host work per collective (s)"
    assert r.source == ("measured: a one-rank fsdp run's mean step 1550.0 ms against the single run's 1050.0 ms, "
                        f"over the {count:g} collectives FSDP sends a step, +- 2 standard errors")
    faster = collective_host(single, timed("fsdp", [0.5, 0.7, 0.6, 0.4]))  # noise: never below 0
    assert (faster.low, faster.mid) == (0.0, 0.0) and faster.high == pytest.approx(max(0.0, -0.5 + err) / count)
    kept = collectives_per_step(from_result(timed("zero2", [1.0] * 4, config={"reshard_after_forward": False})), False)
    assert kept == 13 * (1 + 0 + 1)  # gathered once, kept until backward


def test_the_measured_host_work_adds_to_fsdps_step_only(monkeypatch):
    from stnb.strategies.fsdp import collectives_per_step

    single, one = timed("single", [1.0, 1.2, 1.1, 0.9]), timed("fsdp", [1.5, 1.7, 1.6, 1.4])
    names = ["fsdp", "zero2", "ddp"]
    without = predict(single, devices=[4], link="pcie4", strategies=names)
    pred = predict(single, devices=[4], link="pcie4", strategies=names, one_rank=one)
    m = pred.measured
    host = pred.extra["ranges"][-1]
    assert m.collective_host == host.mid and without.measured.collective_host == 0.0
    for name, resharded in (("fsdp", True), ("zero2", False)):
        grown = pred.row(name, 4)["step_ms"] - without.row(name, 4)["step_ms"]
        assert grown == pytest.approx(1e3 * host.mid * collectives_per_step(m, resharded))
        assert pred.row(name, 4)["comm_exposed_ms"] - without.row(name, 4)["comm_exposed_ms"] == pytest.approx(grown)
        assert pred.row(name, 4)["low"] < pred.row(name, 4)["samples_per_second"] < pred.row(name, 4)["high"]
    assert pred.row("ddp", 4)["step_ms"] == without.row("ddp", 4)["step_ms"]
    assert "collective_host" in pred.extra["inputs"]
    text = "\n".join(pred.assumptions)
    assert f"range: {host.describe()}" in text and "ASSUMED: FSDP's host work per collective" not in text
    assert "MEASURED: forward, backward compute, data + rest (the time split's phases)" in text  # the others stay
    assert ("ASSUMED: FSDP's host work per collective (0: give a one-rank FSDP run (one_rank=) to measure it)"
            in without.assumptions)


@pytest.mark.parametrize("change, words", [
    (dict(strategy="ddp"), "one_rank must be a one-rank run of a strategy that shards the parameters (fsdp), got "
                           "'ddp' on 1 rank(s); stnblab.scaling.one_rank makes one"),
    (dict(world=2), "got 'fsdp' on 2 rank(s)"),
    (dict(strategy="nonesuch"), "got 'nonesuch' on 1 rank(s)"),
    (dict(per_device_batch_size=3), "one_rank's batch per device (3) is not the single run's (8): run both with the "
                                    "same settings"),
    (dict(device="cuda"), "one_rank's device (cuda) is not the single run's (cpu)"),
    (dict(verification={"model_shape": {"param_count": 61}}), "one_rank's model (61) is not the single run's (60)"),
])
def test_a_one_rank_run_that_cannot_measure_the_host_work_is_refused_with_the_reason(change, words):
    change = dict(change)  # the parameter is shared by every run of the test
    single = timed("single", [1.0] * 4)
    one = timed(change.pop("strategy", "fsdp"), [1.5] * 4, world=change.pop("world", 1), **change)
    with pytest.raises(ConfigError) as e:
        predict(single, devices=[2], link="pcie4", strategies=["fsdp"], one_rank=one)
    assert words in str(e.value)
