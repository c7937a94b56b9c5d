"""stnblab.bench.baseline: notebook 05 measures and saves the side-by-side baseline, 06 and 08 reuse it.

The measuring itself is the bench's knobs section (tests/test_bench.py runs it); here the measurement
is replaced by a stand-in that counts its calls, so saving, reusing on a match and re-measuring on a
mismatch are checked without starting processes.
"""

from __future__ import annotations

import importlib
import json
import time

import pytest

from stnb.profiles import PROFILES, Profile
from stnblab.bench import BenchOptions, plan

shared = importlib.import_module("stnblab.bench.shared_baseline")  # the module (the package binds the name to the function)
WHOLE = "single 2 threads (whole machine)"


def _profile(**over):
    return Profile(name="ci", **{**PROFILES["ci"], **over})


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Each measurement returns different numbers and is recorded; the file lives in tmp_path."""
    calls = []

    def fake(prof, device, key):
        calls.append(key)
        k = len(calls)
        sps = {"single 1 device (1 thread)": 30.0 * k, "ddp defaults": 45.0 * k,
               "2 x single at once (no communication)": 60.0 * k, WHOLE: 50.0 * k}
        return shared.Baseline(samples_per_second=sps, name=WHOLE, key={**key, "ranks": 2},
                               measured_at=1_700_000_000.0, seconds=12.0)

    monkeypatch.setattr(shared, "_measure", fake)
    monkeypatch.setenv(shared.ENV, str(tmp_path / "cache" / "baseline.json"))
    return calls


def test_measures_saves_and_reuses_on_a_match(measured, tmp_path, capsys):
    import stnblab

    assert stnblab.bench.baseline is shared.baseline      # what notebooks 05, 06 and 08 call
    first = shared.baseline(_profile(), "cpu", notebook="05")
    assert len(measured) == 1 and first.source.startswith("measured now")
    saved = json.loads((tmp_path / "cache" / "baseline.json").read_text())
    assert saved["key"]["model"] == "tiny" and saved["key"]["profile"] == "ci" and saved["key"]["cores"] >= 1
    assert saved["notebook"] == "05" and saved["baseline"] == WHOLE and saved["samples_per_second"][WHOLE] == 50.0

    again = shared.baseline(_profile(), "cpu", reuse=True, notebook="08")
    assert len(measured) == 1, "a matching saved baseline is reused, not measured again"
    assert again.samples_per_second == first.samples_per_second and again.name == WHOLE
    assert again.source.startswith("measured in notebook 05 at ") and again.source.endswith("reused")
    out = capsys.readouterr().out
    assert f"baseline: {WHOLE}; measured in notebook 05 at" in out
    assert str(tmp_path) not in out, "the path is never printed"


@pytest.mark.parametrize("change, why", [({"model": "minilm"}, "model"), ({"bench_steps": 20}, "steps"),
                                         ({"per_device_batch_size": 16}, "batch_size")])
def test_a_mismatch_measures_again_and_says_why(measured, change, why, capsys):
    shared.baseline(_profile(), "cpu", notebook="05")
    other = shared.baseline(_profile(**change), "cpu", reuse=True, notebook="06")
    assert len(measured) == 2
    assert other.source.startswith("measured now") and f"measured with {why}" in other.source
    assert other["ddp defaults"] == 90.0                  # the new numbers, saved in place of the old ones
    assert shared.baseline(_profile(**change), "cpu", reuse=True).source.startswith("measured in notebook 06")
    assert len(measured) == 2


@pytest.mark.parametrize("machine, why", [("cores", "cores"), ("profile", "profile")])
def test_a_baseline_from_another_machine_or_profile_is_measured_again(measured, monkeypatch, machine, why):
    """Samples/s depend on the machine: a baseline saved with 2 cores is not reused on 4 (a laptop's numbers on a
    workstation), nor one saved under another profile with the same model, steps and batch (the workshop's
    notebook 05 does not stand for the ci run's 06). Reused again once the machine is the one it was measured on."""
    import stnb.hardware

    monkeypatch.setattr(stnb.hardware, "cpu_cores", lambda: 2)
    shared.baseline(_profile(), "cpu", notebook="05")
    if machine == "cores":
        monkeypatch.setattr(stnb.hardware, "cpu_cores", lambda: 4)
        prof = _profile()
    else:
        prof = Profile(name="workshop", **PROFILES["ci"])   # every value the ci profile's, only the name differs
    other = shared.baseline(prof, "cpu", reuse=True, notebook="06")
    assert len(measured) == 2, "a baseline measured on another machine is not reused"
    was, now = (2, 4) if machine == "cores" else ("'ci'", "'workshop'")
    assert other.source == f"measured now, in 12 s (the saved baseline was measured with {why} {was}, this notebook " \
                           f"has {now})"
    assert other.key[why] == (4 if machine == "cores" else "workshop")
    assert shared.baseline(prof, "cpu", reuse=True).source.startswith("measured in notebook 06")
    assert len(measured) == 2


def test_another_device_or_no_file_measures(measured, tmp_path, monkeypatch):
    assert shared.baseline(_profile(), "cpu", reuse=True).source == \
        "measured now, in 12 s (no saved baseline (notebook 05 measures and saves it))"
    assert "device" in shared.baseline(_profile(), "cuda", reuse=True).source
    (tmp_path / "cache" / "baseline.json").write_text("{not json")
    assert "no saved baseline" in shared.baseline(_profile(), "cuda", reuse=True).source
    assert len(measured) == 3


def test_verdict_and_table_are_computed_from_the_numbers():
    sps = {"single 1 device (1 thread)": 30.0, "ddp defaults": 45.0, "2 x single at once (no communication)": 60.0,
           WHOLE: 50.0}
    base = shared.Baseline(samples_per_second=sps, name=WHOLE, key={"ranks": 2}, measured_at=0.0, seconds=1.0)
    assert base.table.loc["ddp defaults", "vs_baseline"] == pytest.approx(0.9)
    text = base.verdict()
    assert "DDP x2 is 1.50x single 1 device (1 thread)" in text and "0.90x single 2 threads" in text
    assert "slower than the baseline" in text and "cost DDP 25% here" in text
    base.samples_per_second["ddp defaults"] = 60.0
    assert "faster than the baseline" in base.verdict() and "cost DDP 0% here" in base.verdict()
    assert "other programs" not in base.verdict()
    base.other_load = {WHOLE: 0.4, "ddp defaults": 0.01}
    assert "other programs used up to 40% of the CPUs" in base.verdict()
    assert base.table.loc[WHOLE, "other_load"] == 0.4


def test_faster_or_slower_than_the_baseline_outside_5_percent_the_same_inside():
    """``Baseline.against``: what verdict() and notebook 08's fastest knob say, from one rule."""
    base = shared.Baseline(samples_per_second={WHOLE: 50.0}, name=WHOLE, key={"ranks": 2}, measured_at=0.0,
                           seconds=1.0)
    assert [base.against(v) for v in (52.6, 52.4, 50.0, 47.6, 47.4)] == [
        "faster than", "about as fast as", "about as fast as", "about as fast as", "slower than"]


def test_a_notebook_compares_with_the_baseline_measured_beside_its_runs_and_says_how_far_the_machine_moved():
    """Notebook 08 reused 05's table (DDP 60.2, the whole machine 75.5), then measured every run a quarter slower:
    its fastest variant (64.3) is faster than the whole machine measured beside it, not 0.85x the saved one."""
    import pandas as pd

    from stnb.errors import ConfigError

    saved = shared.Baseline(samples_per_second={"single 1 device (1 thread)": 39.2, "ddp defaults": 60.2,
                                                WHOLE: 75.5}, name=WHOLE, key={"ranks": 2}, measured_at=0.0,
                            seconds=1.0, notebook="05")
    frame = pd.DataFrame({"variant": ["single 1 device (1 thread)", "ddp defaults", "ddp accumulate 4", WHOLE],
                          "samples_per_second": [29.4, 45.2, 64.3, 56.6]})
    now = saved.remeasured(frame)
    assert now.samples_per_second == {"single 1 device (1 thread)": 29.4, "ddp defaults": 45.2, WHOLE: 56.6}
    assert now.name == WHOLE and now.source == "measured now, beside these runs"
    assert now.key == saved.key and now.key is not saved.key and now.seconds == 0.0
    assert abs(now.measured_at - time.time()) < 60
    assert now.against(64.3) == "faster than" and saved.against(64.3) == "slower than"
    assert saved.drift(now) == (
        "single 1 device (1 thread): 29.4 samples/s now, 0.75x notebook 05's 39.2\n"
        "ddp defaults: 45.2 samples/s now, 0.75x notebook 05's 60.2\n"
        f"{WHOLE}: 56.6 samples/s now, 0.75x notebook 05's 75.5\n"
        "this machine runs 25% slower now than for notebook 05's table (other programs, another host): a ratio of a "
        "run now to that table carries it")
    steady = saved.remeasured(pd.DataFrame({"variant": ["ddp defaults", WHOLE], "samples_per_second": [66.0, 68.0]}))
    assert saved.drift(steady).endswith("\nthis machine runs as it did for notebook 05's table (within 10%)")
    faster = saved.remeasured(pd.DataFrame({"variant": ["ddp defaults", WHOLE], "samples_per_second": [67.0, 84.0]}))
    assert "this machine runs 11% faster now than for notebook 05's table" in saved.drift(faster)
    saved.notebook = None
    assert saved.drift(steady) == ("ddp defaults: 66.0 samples/s now, 1.10x the saved table's 60.2\n"
                                   f"{WHOLE}: 68.0 samples/s now, 0.90x the saved table's 75.5\n"
                                   "this machine runs as it did for the saved table (within 10%)")
    with pytest.raises(ConfigError, match="measured no 'single 2 threads \\(whole machine\\)' run to compare with: "
                                          "run it with whole_machine=True"):
        saved.remeasured(frame[frame.variant != WHOLE])


def test_the_side_by_side_variant_is_found_by_its_name_only():
    """The ceiling (N single runs at once) is one name, made and recognised in stnblab.bench.planning."""
    from stnblab.bench.planning import concurrent_name, is_concurrent

    assert is_concurrent(concurrent_name(2)) and is_concurrent(concurrent_name(3) + ": 0.98 of the limit")
    assert not any(is_concurrent(v) for v in ("ddp defaults", WHOLE, "single 1 device (1 thread)",
                                               "the runs were at once noisy"))
    base = shared.Baseline(samples_per_second={WHOLE: 50.0, "ddp defaults": 45.0, concurrent_name(2): 60.0},
                           name=WHOLE, key={"ranks": 2}, measured_at=0.0, seconds=1.0)
    assert base.ceiling == concurrent_name(2)
    del base.samples_per_second[concurrent_name(2)]
    assert base.ceiling is None and "independent processes" not in base.verdict()


def test_whole_machine_variant_is_planned_on_cpu_only_when_asked(monkeypatch):
    import stnb.hardware

    monkeypatch.setattr(stnb.hardware, "cpu_cores", lambda: 4)
    opts = BenchOptions.from_preset("quick", sections=("knobs",), knobs=("defaults",), device="cpu",
                                          comparison_nproc=2, batch_size=8)
    assert not [it for it in plan(opts) if "whole machine" in it.name]
    items = {it.name: it for it in plan(BenchOptions(**{**opts.__dict__, "whole_machine": True}))}
    whole = items["single 4 threads (whole machine)"]
    assert whole.config.threads_per_rank == 4 and whole.config.per_device_batch_size == 16   # DDP's global batch
    assert items["ddp defaults"].config.threads_per_rank == 2


def test_writers_saving_at_once_never_fail_and_leave_a_whole_file(tmp_path):
    """Under make test's workers notebooks 05, 06 and 08 may each measure and save at the same moment: every
    save succeeds, the file is always whole, and no temporary file is left behind."""
    from concurrent.futures import ThreadPoolExecutor

    base = shared.Baseline(samples_per_second={WHOLE: 50.0}, name=WHOLE, key={"model": "tiny", "ranks": 2},
                           measured_at=1_700_000_000.0, seconds=1.0, notebook="05")
    path = tmp_path / "baseline.json"

    def save_many(_):
        for _ in range(150):
            shared._save(base, path)
            assert json.loads(path.read_text())["baseline"] == WHOLE

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(save_many, range(4)))   # re-raises a writer's error
    assert [p.name for p in tmp_path.iterdir()] == ["baseline.json"]
