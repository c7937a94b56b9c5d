"""python -m stnb bench: persisted sweeps, resume, corrupted files, the st-docs refusal, the report.

Real runs use the tiny random BERT and 3 steps; no test looks at a timing value.
"""

import json
import os
import subprocess
import sys

import pytest

import procs

import stnb
from stnblab import bench
from stnb.__main__ import main as cli

TINY = ["--model", "tiny", "--steps", "3", "--warmup", "1", "--train-size", "64", "--batch-size", "4"]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tag(row):
    return row["config"]["extra"]["bench"]


def test_sweep_one_line_per_run_resume_and_report(tmp_path, capsys):
    results, report = tmp_path / "runs.jsonl", tmp_path / "report.html"
    args = ["bench", "--sweep", "--strategies", "dp,single", "--batch-sizes", "4,8", *TINY,
            "--results", str(results), "--report", str(report)]
    assert cli(args) == 0
    out = capsys.readouterr().out
    rows = _lines(results)
    assert len(rows) == 4, "one line per run"
    by = {_tag(r)["name"]: r for r in rows}
    assert set(by) == {"dp b4", "dp b8", "single b4", "single b8"}
    for name in ("single b4", "single b8"):
        assert by[name]["status"] == "ok" and by[name]["verified"] and by[name]["samples_per_second"] > 0
    assert by["single b8"]["global_batch_size"] == 8
    assert by["dp b4"]["status"] == "not runnable here" and "GPU" in by["dp b4"]["reason"]
    assert "== sweep (stnb.run) ==" in out and "single b8" in out
    # the report: a standalone page with the summary and plotly figures
    page = report.read_text()
    assert "<html" in page and "stnb bench" in page and "single b8" in page and "plotly" in page.lower()

    # re-running the same command resumes: nothing runs again, the file is unchanged
    before = results.read_text()
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "4 already there, 0 to run" in out
    assert results.read_text() == before

    # a crash mid-sweep loses only the unfinished run: drop the last line, re-run, one run happens
    results.write_text("".join(line + "\n" for line in before.splitlines()[:3]))
    missing = _tag(json.loads(before.splitlines()[3]))["name"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "3 already there, 1 to run" in out and f"sweep: {missing}" in out
    rows = _lines(results)
    assert len(rows) == 4 and sorted(_tag(r)["name"] for r in rows) == sorted(by)
    assert rows[:3] == [json.loads(line) for line in before.splitlines()[:3]], "finished runs are kept as they were"
    assert not procs.children(), "a rank process survived the bench"


def test_launchers_and_knobs_sections(tmp_path, capsys):
    """The same train_rank under stnb.launch, raw notebook_launcher and torchrun, and a DDP knob."""
    results = tmp_path / "cmp.jsonl"
    args = ["bench", "--launchers", "--ddp-knobs", "--knobs", "embedding rows hook", "--repeats", "1", *TINY,
            "--results", str(results), "--report", str(tmp_path / "cmp.html")]
    assert cli(args) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    rows = _lines(results)
    launchers = {_tag(r)["name"]: r for r in rows if _tag(r)["section"] == "launchers"}
    for name, launcher in (("ddp stnb.launch", "stnb"), ("ddp notebook_launcher", "notebook_launcher"),
                           ("ddp torchrun", "torchrun")):
        r = launchers[name]
        assert r["status"] == "ok", r["reason"]
        assert r["launcher"] == launcher and r["world_size"] == 2 and r["verified"] is True
        assert r["verification"]["weights_identical_across_ranks"] is True
        assert r["time_to_first_step_s"] > 0 and r["samples_per_second"] > 0
    assert launchers["single 1 device (1 thread)"]["config"]["threads_per_rank"] == 1
    knobs = {_tag(r)["name"]: r for r in rows if _tag(r)["section"] == "knobs"}
    rows_hook = knobs["ddp embedding rows hook"]
    assert rows_hook["status"] == "ok" and rows_hook["config"]["comm_hook"] == "embedding_rows"
    assert rows_hook["verification"]["weights_checksums"] == knobs["ddp defaults"]["verification"]["weights_checksums"]
    conc = knobs["2 x single at once (no communication)"]
    assert conc["status"] == "ok" and len(conc["verification"]["independent_runs"]) == 2
    # the summary names every ratio and gives a verdict for every target, whatever the numbers
    for text in ("stnb / notebook_launcher", "stnb / torchrun", "efficiency stnb", "== targets =="):
        assert text in out
    targets = [line for line in out.splitlines() if line.startswith(("PASS", "BELOW"))]
    assert len(targets) == len(bench.TARGETS)
    assert not procs.children()


def test_corrupted_results_file_is_reported_not_overwritten(tmp_path, capsys):
    results = tmp_path / "runs.jsonl"
    good = json.dumps({"strategy": "single", "status": "ok"})
    results.write_text(good + "\n{not json\n")
    before = results.read_bytes()
    rc = cli(["bench", "--sweep", "--strategies", "single", "--batch-sizes", "4", *TINY, "--results", str(results)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "corrupted at line 2" in err and "not modified" in err
    assert results.read_bytes() == before
    assert not (tmp_path / "runs.html").exists()


def test_st_docs_refuses_without_a_gpu_and_needs_no_hub(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("STNB_FORCE_CPU", "1")  # no GPU, whatever this machine has
    rc = cli(["bench", "--preset", "st-docs", "--results", str(tmp_path / "docs.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "preset 'st-docs' cannot run here" in err and "this machine has 0 CUDA GPUs" in err
    assert "--device cpu" in err and "does not substitute" in err
    assert "hub" not in err.lower(), "offline mode is no longer a reason: the preset needs no network"
    assert not any(tmp_path.iterdir()), "nothing may run (or be written) before the refusal"


def test_st_docs_refuses_through_the_command_line():
    env = dict(os.environ, HF_HUB_OFFLINE="1", STNB_FORCE_CPU="1")
    out = subprocess.run([sys.executable, "-m", "stnb", "bench", "--preset", "st-docs"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "preset 'st-docs' cannot run here" in out.stderr


def test_st_docs_preset_is_the_docs_setting_offline():
    opts = bench.BenchOptions.from_preset("st-docs")
    assert (opts.model, opts.max_seq_length, opts.batch_sizes, opts.data, opts.loss) == \
        ("mpnet-base-random", 384, (32,), "synthetic", "softmax+cosine")
    from stnb.models import BUNDLED
    assert opts.model in BUNDLED


def test_st_docs_runs_offline_on_cpu_at_reduced_size(tmp_path, monkeypatch, capsys):
    """The st-docs preset's own code path (the mpnet build, the sweep), at the reduced size, on CPU,
    with the hub offline: a single and a 2-rank DDP row, MFU inputs measured."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    results = tmp_path / "docs.jsonl"
    args = ["bench", "--preset", "st-docs", "--device", "cpu", "--model", "mpnet-mini-random",
            "--max-seq-length", "32", "--batch-sizes", "4", "--strategies", "single,ddp", "--nprocs", "2",
            "--steps", "3", "--warmup", "1", "--train-size", "64", "--results", str(results),
            "--report", str(tmp_path / "docs.html")]
    assert cli(args) == 0
    out = capsys.readouterr().out
    rows = {_tag(r)["name"]: r for r in _lines(results)}
    assert set(rows) == {"single b4", "ddp x2 b4"}
    for r in rows.values():
        assert r["status"] == "ok" and r["verified"], r["reason"]
        assert r["model"] == "mpnet-mini-random" and r["config"]["data"] == "synthetic"
        assert r["config"]["max_seq_length"] == 32
        m = r["mfu"]
        # two texts per pair, each padded to its batch's longest (<= 32 tokens)
        assert 2 <= m["tokens_per_sample"] <= 2 * 32 and m["flops_per_sample"] > 0
        assert m["mfu"] is None and "CPU" in m["peak_source"]  # no peak on CPU: no MFU claimed
    assert rows["ddp x2 b4"]["verification"]["ranks"][0]["wrapper"] == "DistributedDataParallel"
    assert "MFU" in out and "tokens/sample" in out
    assert "NOT MultiNLI, SNLI or STSB" in (tmp_path / "docs.html").read_text()
    for r in rows.values():  # the seed's recipe: both losses, the classifier kept in sync across ranks
        assert r["config"]["loss"] == "softmax+cosine"
        assert set(r["verification"]["loss_inputs_per_dataset"]) == {"nli", "sts"}
    assert rows["ddp x2 b4"]["verification"]["ranks"][0]["trained_parameters"]["loss"] == \
        ["loss[nli].classifier.weight", "loss[nli].classifier.bias"]


def test_plan_is_interleaved_and_keys_are_stable():
    opts = bench.BenchOptions.from_preset("quick", sections=("launchers", "knobs"), repeats=2)
    items = bench.plan(opts)
    keys = [it.key for it in items]
    assert len(keys) == len(set(keys)), "every planned run has its own key"
    assert keys == [it.key for it in bench.plan(opts)], "keys do not change between invocations"
    launchers = [it for it in items if it.section == "launchers"]
    first = [it.name for it in launchers if it.repeat == 0]
    second = [it.name for it in launchers if it.repeat == 1]
    assert sorted(first) == sorted(second) and first != second, "repeats are interleaved in a rotating order"
    # a different setting is a different run (no false resume)
    other = bench.plan(bench.BenchOptions.from_preset("quick", sections=("launchers",), repeats=2, steps=9))
    assert not set(keys) & {it.key for it in other}


def test_targets_verdicts():
    assert bench.target_verdict("stnb_vs_raw", 0.99)["verdict"] == "PASS"
    assert bench.target_verdict("stnb_vs_raw", 0.97)["verdict"] == "BELOW"
    assert bench.target_verdict("overhead", 0.01)["verdict"] == "PASS"
    assert bench.target_verdict("overhead", 0.03)["verdict"] == "BELOW"
    assert bench.target_verdict("efficiency_best", None)["verdict"] == "n/a"


def test_ddp_knob_combinations_refused_before_any_process_starts():
    with pytest.raises(stnb.ConfigError, match="143580"):
        stnb.TrainConfig(strategy="ddp", num_processes=2, model="tiny", static_graph=True,
                         gradient_accumulation_steps=2).validate(check_resources=False)
    if not stnb.hardware_report().gpus:
        with pytest.raises(stnb.ConfigError, match="comm_hook='bf16' needs CUDA"):
            stnb.TrainConfig(strategy="ddp", num_processes=2, model="tiny", device="cpu",
                             comm_hook="bf16").validate()


def test_accumulate_option_names_and_baselines_the_variants(capsys):
    opts = bench.BenchOptions.from_preset("default", sections=("knobs",), repeats=1, accumulate=8,
                                          knobs=("accumulate 8 + embedding rows hook + no broadcast",
                                                 "system allocator (page faults)"))
    items = {it.name: it for it in bench.plan(opts)}
    best = items["ddp accumulate 8 + embedding rows hook + no broadcast"]
    assert best.config.gradient_accumulation_steps == 8 and best.config.comm_hook == "embedding_rows"
    assert best.config.broadcast_buffers is False
    assert best.baseline == "single 1 device (1 thread), accumulate 8"
    assert items[best.baseline].config.gradient_accumulation_steps == 8
    alloc = items["ddp system allocator (page faults)"]
    assert alloc.baseline == "single 1 device (1 thread), system allocator"
    assert items[alloc.baseline].config.reuse_freed_memory is False
    assert cli(["bench", "--ddp-knobs", "--accumulate", "1"]) == 2
    assert "--accumulate must be >= 2" in capsys.readouterr().err


def test_the_checkpoints_section_measures_each_strategys_checkpoint_and_who_wrote_it(tmp_path, capsys):
    """``--checkpoints``: every strategy trains with checkpoint_every (4 checkpoints of 8 steps), its checkpoint's
    seconds (the slowest rank's) and the bytes each rank wrote come from the run; fsdp's and zero2's two ranks each
    write about half of what one device writes, ddp's rank 0 all of it and rank 1 next to nothing; the folders are
    removed after each run; the document's section shows the same numbers."""
    results, doc = tmp_path / "quick.jsonl", tmp_path / "BENCH.md"
    assert cli(["bench", "--quick", "--checkpoints", "--results", str(results), "--write-doc", str(doc)]) == 0
    out = capsys.readouterr().out
    rows = {_tag(r)["name"]: r for r in _lines(results)}
    assert rows["dp"]["status"] == "not runnable here"
    ran = {k: r for k, r in rows.items() if k != "dp"}
    assert set(ran) == {"single", "ddp x2", "zero1 x2", "zero2 x2", "fsdp x2", "deepspeed x2"}
    assert all(r["status"] == "ok" and r["verified"] for r in ran.values()), {k: r["reason"] for k, r in ran.items()}
    assert all([c["step"] for c in r["checkpoints"]] == [2, 4, 6, 8] for r in ran.values())
    assert all(c["seconds"] > 0 for r in ran.values() for c in r["checkpoints"])
    one = rows["single"]["checkpoints"][-1]["bytes_written"][0]
    for name in ("zero2 x2", "fsdp x2"):
        wrote = rows[name]["checkpoints"][-1]["bytes_written"]
        assert len(wrote) == 2 and all(0.35 * one < b < 0.65 * one for b in wrote), (name, wrote, one)
    rank0, rank1 = rows["ddp x2"]["checkpoints"][-1]["bytes_written"]
    assert 0.9 * one < rank0 < 1.1 * one and rank1 < 0.05 * one
    assert not os.listdir(tmp_path / "quick-checkpoints"), "a run's checkpoints were left behind"
    summary = {r["variant"]: r for r in bench.summarize(bench.plan(bench.BenchOptions.from_preset(
        "quick", sections=("checkpoints",), results=str(results))), {_tag(r)["key"]: r for r in _lines(results)},
        bench.BenchOptions.from_preset("quick"))["sections"]["checkpoints"]}
    fsdp = summary["fsdp x2"]
    assert fsdp["checkpoints"] == 4 and abs(fsdp["largest_share"] - 0.5) < 0.1
    section = doc.read_text().split("<!-- stnb-bench:quick/cpu/checkpoints -->")[1]
    cells = next(line for line in section.splitlines() if line.startswith("| fsdp x2 |")).split(" | ")
    assert cells[1:4] == ["4", f"{fsdp['seconds']:.2f}", " / ".join(f"{b / 1e6:.1f}" for b in fsdp["bytes_per_rank"])]
    assert "== checkpoints: seconds (slowest rank)" in out
    assert not procs.children()
