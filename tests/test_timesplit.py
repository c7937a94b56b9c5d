"""Where the step time goes (stnb.timesplit), measured in real 2-rank gloo runs of the tiny model."""

import pytest

import stnb
from stnb.timesplit import PHASES, combine

RUN = dict(model="tiny", steps=8, train_size=256, dev_size=32, evaluate=False, warmup_steps_excluded=2)
SPLIT_TOLERANCE = 0.05  # the done-when of issue 20: the parts add up to the step within 5%


@pytest.fixture(scope="module")
def ddp():
    return stnb.run(stnb.TrainConfig(strategy="ddp", num_processes=2, **RUN), echo=False)


@pytest.fixture(scope="module")
def ddp_fp16():
    return stnb.run(stnb.TrainConfig(strategy="ddp", num_processes=2, comm_hook="fp16", **RUN), echo=False)


def _steady(result, rank):
    return result.time_split[rank]["steps"][RUN["warmup_steps_excluded"]:]


def test_ddp_split_adds_up_to_the_measured_step(ddp):
    assert ddp.verified, ddp.reason
    assert len(ddp.time_split) == 2
    for rank, split in enumerate(ddp.time_split):
        assert split["method"].startswith("clock") and split["comm"] == "DDP bucket hooks"
        steps = split["steps"]
        assert len(steps) == ddp.steps
        # the rank's step is the one stnb's throughput is computed from (merge keeps the slowest rank's)
        for st, slowest in zip(steps, ddp.step_times):
            assert st["step"] <= slowest + 1e-9
        steady = _steady(ddp, rank)
        for st in steady:
            parts = [st[p] for p in PHASES] + [st["wait"]]
            assert all(p >= 0 for p in parts), st
            assert sum(parts) == pytest.approx(st["step"], rel=1e-9)
            assert st["forward"] > 0 and st["backward_compute"] > 0 and st["optimizer"] > 0
            assert st["comm_total"] > 0 and st["comm_exposed"] + st["wait"] > 0
        # what no clock reading attributes ("other": scheduler, zero_grad) stays under 5% of the steps
        unattributed = sum(st["other"] for st in steady) / sum(st["step"] for st in steady)
        assert unattributed < SPLIT_TOLERANCE, f"rank {rank}: {unattributed:.1%} of the step is unattributed"


def test_comm_bytes_are_every_gradient_once_per_step_and_halve_with_fp16(ddp, ddp_fp16):
    trainable = ddp.verification["model_shape"]["trainable_param_count"]
    for result, size in ((ddp, 4), (ddp_fp16, 2)):
        assert result.verified, result.reason
        for rank in range(2):
            assert {st["comm_bytes"] for st in result.time_split[rank]["steps"]} == {size * trainable}
    assert ddp_fp16.time_split[0]["hook"] == "fp16"


def test_single_and_fsdp_runs_split_what_they_can():
    single = stnb.run(stnb.TrainConfig(strategy="single", **RUN), echo=False)
    split = single.time_split[0]
    assert split["comm"] is None and "comm_total" not in split["steps"][-1]
    assert split["units"]["layers"] == 2  # the tiny BERT's blocks: what the predictor's FSDP model needs
    assert all(st["forward"] > 0 and st["backward_compute"] > 0 for st in split["steps"])
    assert "wait" in split["steps"][-1] and split["steps"][-1]["wait"] is None
    fsdp = stnb.run(stnb.TrainConfig(strategy="fsdp", num_processes=2, **RUN), echo=False)
    assert fsdp.verified, fsdp.reason
    for split in fsdp.time_split:
        assert split["comm"].startswith("FSDP forward all-gathers")
        assert split["units"]["layers"] == 2 and 0 < split["units"]["root_fraction"] < 1  # FSDP's own units
        units = fsdp.verification["ranks"][0]["wrapped_layers"] + 1  # the layers and the root
        for st in split["steps"][RUN["warmup_steps_excluded"]:]:
            assert st["gathers"] >= units and st["comm_total"] > 0 and st["forward"] > 0
            assert st["comm_exposed"] >= st["comm_total"]  # blocking on CPU: all of it exposed
            assert sum(st[p] for p in PHASES) == pytest.approx(st["step"], rel=1e-9)


def test_combine_splits_wait_off_the_exposed_communication():
    def rank(end, exposed):
        return {"steps": [{"backward_compute_end": end, "comm_exposed": exposed, "step": 1.0}]}

    fast, slow = combine([rank(1.0, 0.5), rank(1.3, 0.1)])
    assert fast["steps"][0]["wait"] == pytest.approx(0.3) and fast["steps"][0]["comm_exposed"] == pytest.approx(0.2)
    assert slow["steps"][0]["wait"] == 0.0 and slow["steps"][0]["comm_exposed"] == pytest.approx(0.1)
    capped, _ = combine([rank(1.0, 0.1), rank(2.0, 0.1)])  # never more wait than exposed time
    assert capped["steps"][0]["wait"] == pytest.approx(0.1) and capped["steps"][0]["comm_exposed"] == 0.0


def test_split_figures_add_up_and_say_what_dominates(ddp):
    from stnb.plots import timesplit as pt

    fig = pt.split_bars([ddp])
    bars = [t for t in fig.data if t.type == "bar"]
    mean_step = pt.means(ddp)["step"] * 1e3
    assert sum(t.y[0] for t in bars) == pytest.approx(mean_step, rel=1e-6)  # the stack is the step
    assert {t.name for t in bars} >= {"forward (+ loss)", "backward compute", "optimizer"}
    assert any(t.type == "scatter" for t in fig.data)  # the overlapped communication
    line = fig.layout.annotations[0].text
    assert line.startswith("ddp x2: ") and line.endswith(".")  # the sentence, wrapped with <br>
    lanes = {y for t in pt.timeline(ddp).data for y in t.y}
    assert lanes == {"rank 0 compute", "rank 1 compute", "rank 0 comm", "rank 1 comm"}


def test_problems_accepts_a_measured_split_and_names_what_does_not_add_up(ddp):
    from stnb.timesplit import problems

    assert problems(ddp) == []
    broken = ddp.to_dict()
    steps = broken["time_split"][1]["steps"]
    for st in steps:  # half of every step attributed to nothing: what a missed phase would look like
        st["other"] += st["step"]
        st["step"] *= 2
    steps[-1]["forward"] = 0.0
    found = problems(broken)
    assert any(p.startswith("rank 1:") and "attributed to nothing" in p for p in found), found
    assert any(p.startswith(f"rank 1 step {len(steps) - 1}:") and "no forward" in p for p in found), found
    assert not any(p.startswith("rank 0") for p in found), found
    assert problems(dict(broken, time_split=[])) == ["no time split in the result"]


def test_marks_become_seconds_once_the_step_is_done():
    """The clock is pluggable (CUDA events on a GPU): a step whose end mark is not done yet stays
    pending and is resolved in order once it is, or by ``summary`` (which waits for the device)."""
    from stnb.timesplit import HostClock, StepTimer

    class LateClock(HostClock):  # marks that complete only when ``settle`` is called, like CUDA events
        def __init__(self):
            self.settled = False

        def done(self, mark):
            return self.settled

        def settle(self):
            self.settled = True

    clock = LateClock()
    timer = StepTimer(clock=clock, enabled=True)
    timer.method, timer.origin = "late", 0.0
    timer.on_step_begin(1.0)
    for end in (2.0, 3.5):
        timer.on_step_end(end)
    assert timer.steps == []
    steps = timer.summary()["steps"]
    assert [st["step"] for st in steps] == [1.0, 1.5] and [st["start"] for st in steps] == [1.0, 2.0]
