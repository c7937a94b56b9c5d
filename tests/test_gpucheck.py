"""python -m stnb gpu-check: the plan for simulated hardware, the report from synthetic outcomes,
the orchestration's skip / budget rules, reading nvidia-smi, and the real no-GPU run on this machine.

The GPU checks themselves need a GPU (``make gpu-check`` on one); here everything around them runs.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from stnblab import gpucheck
from stnblab.gpucheck import checks, planning, report as reporting
from stnblab.gpucheck.planning import Machine

H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2 ** 30, "compute_capability": [9, 0]}
T4 = {"index": 0, "name": "Tesla T4", "memory_bytes": 15 * 2 ** 30, "compute_capability": [7, 5]}
P100 = {"index": 0, "name": "Tesla P100-PCIE-16GB", "memory_bytes": 16 * 2 ** 30, "compute_capability": [6, 0]}
ARCH = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # a cu128 build's list


def gpus(proto, n):
    return [dict(proto, index=i) for i in range(n)]


def names(machine):
    return [c.name for c in gpucheck.plan(machine)]


def test_plan_without_gpu_is_empty():
    assert gpucheck.plan(Machine(gpus=[], no_gpu_reason="CPU-only torch build")) == []


def test_plan_one_gpu():
    ch = gpucheck.plan(Machine(gpus=gpus(H100, 1), torch_cuda="12.8", arch_list=ARCH, notebook="nb.ipynb"))
    got = [c.name for c in ch]
    assert got == ["hardware", "nccl all_reduce x1", "single bf16", "single fp16", "ddp x1 nccl bf16",
                   "fsdp x1 nccl bf16", "fault: a rank raises (x1 nccl)", "fault: a rank is killed (x1 nccl)",
                   "fault: a rank stalls (x1 nccl)", "fault: a peer is aborted (x2 gloo sharing 1 GPU)",
                   "fault: a rank is killed mid-collective (x2 gloo sharing 1 GPU)",
                   "2 ranks on 1 GPU: nccl, gloo on CUDA tensors", "stnb strategies x2 sharing 1 GPU",
                   "single bf16 memory budget",
                   "single bf16 save_to",
                   "single bf16 reranker", "single bf16 sparse", "notebook 00",
                   "plain sentence-transformers vs stnb single", "bench st-docs single"]
    assert [c.name for c in ch if c.skip] == ["ddp x1 nccl bf16"], "an H100 runs every other 1-GPU check"
    by = {c.name: c for c in ch}
    assert by["single fp16"].params["mixed_precision"] == "fp16" and by["single fp16"].params["strategy"] == "single"
    # 1 rank of ddp / fsdp: through the direct path (TrainConfig refuses them for users)
    assert by["fsdp x1 nccl bf16"].kind == "train_direct" and by["fsdp x1 nccl bf16"].params["num_processes"] == 1
    assert by["plain sentence-transformers vs stnb single"].params["goal"] == 0.98
    assert all(c.gpus == 1 for c in ch if not c.skip)


def test_plan_two_and_eight_gpus_add_the_multi_gpu_paths():
    two = names(Machine(gpus=gpus(H100, 2), torch_cuda="12.8", arch_list=ARCH, notebook="nb"))
    for n in ("dp x2 bf16", "ddp x2 bf16", "fsdp x2 bf16", "ddp x2 bf16 hook fp16", "ddp x2 bf16 hook bf16",
              "ddp x2 bf16 hook embedding_rows", "fault: a rank raises (x2 nccl)", "nccl all_reduce x2"):
        assert n in two, n
    eight = gpucheck.plan(Machine(gpus=gpus(H100, 8), torch_cuda="12.8", arch_list=ARCH, notebook="nb"))
    by = {c.name: c for c in eight}
    assert by["ddp x8 bf16"].params["num_processes"] == 8 and by["ddp x8 bf16"].gpus == 8
    assert by["dp x8 bf16"].params["strategy"] == "dp"
    assert "fault: a rank is killed (x2 nccl)" in by  # two ranks are enough for the fault matrix
    assert len(eight) == len(two)


def test_plan_gpu_without_bf16():
    ch = gpucheck.plan(Machine(gpus=gpus(T4, 2), torch_cuda="12.8", arch_list=ARCH, notebook="nb"))
    by = {c.name: c for c in ch}
    assert "compute capability >= 8.0" in by["single bf16"].skip and "Tesla T4 has 7.5" in by["single bf16"].skip
    # fp16 is the T4's only fast precision: every multi-GPU row trains in it (dp's autocast, FSDP2's fp16
    # policy and the GradScaler), against the single fp16 row
    for row in ("dp x2 fp16", "ddp x2 fp16", "fsdp x2 fp16", "ddp x2 fp16 hook fp16",
                "ddp x2 fp16 hook embedding_rows", "fsdp x1 nccl fp16"):
        assert by[row].params["mixed_precision"] == "fp16" and not by[row].skip, row
    assert by["ddp x2 fp16 hook bf16"].skip
    assert not [c.name for c in ch if c.params.get("mixed_precision") == "no"]
    assert by["single fp16"].params["mixed_precision"] == "fp16"  # the speed-up base of those rows
    assert by["plain sentence-transformers vs stnb single"].params["mixed_precision"] == "fp16"
    assert not any(c.skip for c in ch if "bf16" not in c.name and "x1" not in c.name)


def _accelerate_wraps_in_ddp(num_processes: int) -> bool:
    """accelerate's own decision for a rank on CUDA GPUs (distributed type MULTI_GPU), asked of its
    properties: Accelerator.prepare_model wraps in DDP when ``multi_device``, which needs
    ``use_distributed``, which needs num_processes > 1. (On CPU, MULTI_CPU wraps unconditionally:
    that is why a 1-rank ddp passes on gloo ranks.)"""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, num_processes=num_processes)
    acc = SimpleNamespace(use_distributed=PartialState.use_distributed.fget(state),
                          distributed_type=DistributedType.MULTI_GPU)
    return Accelerator.multi_device.fget(acc)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_every_ddp_row_planned_is_one_accelerate_wraps(n):
    """A ddp row that runs expects DistributedDataParallel (strategies.verify); with one NCCL rank
    accelerate never wraps, so such a row would fail by construction: it is not run, and says why."""
    assert _accelerate_wraps_in_ddp(2) and not _accelerate_wraps_in_ddp(1)
    ch = gpucheck.plan(Machine(gpus=gpus(H100, n), torch_cuda="12.8", arch_list=ARCH, notebook="nb"))
    ddp = [c for c in ch if c.params.get("strategy") == "ddp"]
    assert ddp
    for c in ddp:
        ranks = c.params.get("num_processes") or 1
        if c.skip is None:
            assert _accelerate_wraps_in_ddp(ranks), f"{c.name}: accelerate would not wrap {ranks} rank(s) in DDP"
        else:
            assert ranks == 1 and "more than one process" in c.skip
    one = {c.name: c for c in ch}["fsdp x1 nccl bf16"]
    assert one.skip is None  # stnb shards FSDP2 itself: one rank of it is a real FSDP module


def test_multi_gpu_rows_come_before_the_long_rows():
    """Issue 32 item 4.4: on 2x T4 the 450 s budget ran out before the multi-GPU rows, planned after the
    ratio row (4 x 300 steps). Every row that uses 2+ GPUs now starts before the 1-GPU extras and the long rows."""
    ch = gpucheck.plan(Machine(gpus=gpus(T4, 2), torch_cuda="12.8", arch_list=ARCH, notebook="nb"))
    order = [c.name for c in ch]
    first_long = min(i for i, c in enumerate(ch) if c.kind in ("ratio", "st_docs", "notebook", "train_build")
                     or c.params.get("save_to"))
    multi = [i for i, c in enumerate(ch) if c.gpus >= 2]
    assert multi and max(multi) < first_long, order
    assert order[-2:] == ["plain sentence-transformers vs stnb single", "bench st-docs single"]


def test_plan_covers_every_sharding_strategy_save_and_the_other_model_types():
    """Issue 32 item 4.12: zero1 / zero2 / deepspeed on 2+ GPUs, the NCCL peer abort with 2 ranks (listed as not
    run on one GPU, with why), save_to, a CrossEncoder and a SparseEncoder row."""
    from stnb import strategies

    two = {c.name: c for c in gpucheck.plan(Machine(gpus=gpus(H100, 2), torch_cuda="12.8", arch_list=ARCH,
                                                    notebook="nb"))}
    for s in strategies.all_strategies():
        if s.distributed and s.name != "single":
            row = two[f"{s.name} x2 bf16"]
            assert row.params["num_processes"] == 2 and row.gpus == 2 and row.skip is None, s.name
    assert two["fault: a rank raises (x2 nccl)"].params["nproc"] == 2  # a peer is aborted by the failing rank
    assert two["single bf16 save_to"].params["save_to"] is True
    assert {two["single bf16 reranker"].params["build"], two["single bf16 sparse"].params["build"]} == {
        "reranker", "sparse"}
    assert not [c for c in two.values() if c.params.get("share_gpus")]  # 2 GPUs: the peer rows are NCCL's
    one = {c.name: c for c in gpucheck.plan(Machine(gpus=gpus(H100, 1), torch_cuda="12.8", arch_list=ARCH))}
    peer = one["fault: a peer is aborted (x2 gloo sharing 1 GPU)"]
    assert peer.skip is None and peer.params == {"fault": "raise", "nproc": 2, "share_gpus": True}


def test_plan_without_what_a_row_needs_says_so():
    """The GPU image: no bundled MiniLM (rows train the tiny model, the ratio row mpnet-base's shape), no
    nbclient, DeepSpeed missing and transformers too old for fsdp: those rows are listed as not run, with why."""
    from stnblab.gpucheck.builds import BUILDS

    m = Machine(gpus=gpus(H100, 2), torch_cuda="12.8", arch_list=ARCH, notebook="nb", minilm=False,
                missing={"nbclient": "nbclient is not installed", "strategy:deepspeed": "DeepSpeed is not installed",
                         "strategy:fsdp": "needs transformers >= 5.19"})
    by = {c.name: c for c in gpucheck.plan(m)}
    assert by["single bf16"].params["model"] == "tiny"
    assert by["plain sentence-transformers vs stnb single"].params["model"] == "mpnet-base-random"
    assert by["notebook 00"].skip == "nbclient is not installed"
    assert by["deepspeed x2 bf16"].skip == "DeepSpeed is not installed"
    assert by["fsdp x2 bf16"].skip == by["fsdp x1 nccl bf16"].skip == "needs transformers >= 5.19"
    assert by["ddp x2 bf16"].skip is None and set(BUILDS) == {"reranker", "sparse"}


def test_missing_asks_the_strategies(monkeypatch):
    from stnb.strategies import fsdp

    monkeypatch.setattr(fsdp, "installed_transformers", lambda: "5.17.0")
    got = planning.missing()
    assert "5.19" in got["strategy:fsdp"] and "5.19" in got["strategy:zero2"] and "strategy:ddp" not in got


def test_plan_gpu_the_torch_build_cannot_run():
    ch = gpucheck.plan(Machine(gpus=gpus(P100, 1), torch_cuda="12.8", arch_list=ARCH, notebook="nb"))
    assert [c.name for c in ch] == ["hardware"]
    assert "Tesla P100-PCIE-16GB (compute capability 6.0)" in ch[0].params["unsupported"]


def test_plan_without_notebooks_skips_with_reason():
    ch = {c.name: c for c in gpucheck.plan(Machine(gpus=gpus(H100, 1), torch_cuda="12.8", arch_list=ARCH))}
    assert "source checkout" in ch["notebook 00"].skip


# ---- report --------------------------------------------------------------------------------

def _outcomes(fail=False):
    O = reporting.Outcome
    base = {"strategy": "single", "precision": "bf16", "gpus": 1}
    return [O("hardware", "hardware", "passed", 0.1),
            O("single bf16", "train", "passed", 20.0, dict(base, samples_per_second=1000.0, mfu=0.31,
                                                             peak_memory_bytes=3 * 2 ** 30)),
            O("single fp16", "train", "skipped", 0.0, detail="not here"),
            O("ddp x2 bf16", "train", "failed" if fail else "passed", 25.0,
              dict(base, strategy="ddp", gpus=2, samples_per_second=1900.0), error="boom" if fail else "")]


def test_report_counts_speedups_and_exit_code(tmp_path):
    m = Machine(gpus=gpus(H100, 2), torch_cuda="12.8")
    plan = gpucheck.plan(Machine(gpus=gpus(H100, 2), torch_cuda="12.8", arch_list=ARCH, notebook="nb"))
    plan = [c for c in plan if c.name in {"hardware", "single bf16", "single fp16", "ddp x2 bf16"}]
    ok = gpucheck.build(m, plan, _outcomes(), 100.0, 130.26)
    assert ok["counts"] == {"passed": 3, "failed": 0, "skipped": 1, "inconclusive": 0} and gpucheck.exit_code(ok) == 0
    assert ok["verdict"] == "all 3 runnable check(s) passed (1 skipped, each with its reason)"
    assert (ok["stnb_gpu_check"], ok["started"], ok["seconds"]) == (1, 100.0, 30.3)
    assert ok["planned"] == [c.to_dict() for c in plan] and ok["not_run"] == []
    no_skip = gpucheck.build(m, plan[:1], _outcomes()[:1], 100.0, 101.0)
    assert no_skip["verdict"] == "all 1 runnable check(s) passed"
    assert ok["speedups"] == [{"name": "ddp x2 bf16", "strategy": "ddp", "gpus": 2, "samples_per_second": 1900.0,
                               "speedup": 1.9, "efficiency": 0.95}]
    text = gpucheck.table(ok)
    assert "single bf16" in text and "PASSED" in text and "31.0%" in text and "3.00" in text and "1.90x" in text
    bad = gpucheck.build(m, plan, _outcomes(fail=True), 100.0, 130.0)
    assert gpucheck.exit_code(bad) == 1 and "FAILED" in bad["verdict"] and bad["speedups"] == []
    # a planned check with no outcome is a failure too
    missing = gpucheck.build(m, plan, _outcomes()[:2], 100.0, 130.0)
    assert missing["not_run"] == ["ddp x2 bf16", "single fp16"] and gpucheck.exit_code(missing) == 1
    path = gpucheck.write(ok, tmp_path / "sub" / "r.json")
    assert json.loads(open(path).read())["counts"]["passed"] == 3
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


def test_a_planned_check_that_did_not_run_makes_the_verdict_failed_never_passed():
    """Every check that ran passed, but two planned ones never ran (the budget ran out, the process died): the
    table lists them FAILED, not run, the exit status is 1, and the verdict line says so in the same words: they
    are counted with the failures, and no sentence says every check passed."""
    m = Machine(gpus=gpus(H100, 2), torch_cuda="12.8")
    plan = gpucheck.plan(Machine(gpus=gpus(H100, 2), torch_cuda="12.8", arch_list=ARCH, notebook="nb"))
    plan = [c for c in plan if c.name in {"hardware", "single bf16", "single fp16", "ddp x2 bf16"}]
    rep = gpucheck.build(m, plan, _outcomes()[:2], 100.0, 130.0)
    assert rep["counts"]["failed"] == 0 and rep["not_run"] == ["ddp x2 bf16", "single fp16"]
    assert gpucheck.exit_code(rep) == 1
    assert rep["verdict"] == "2 of 4 planned check(s) FAILED"
    lines = gpucheck.table(rep).splitlines()
    assert [ln.split() for ln in lines if ln.endswith(" not run")] == [
        ["ddp", "x2", "bf16", "FAILED", "not", "run"], ["single", "fp16", "FAILED", "not", "run"]]
    assert lines[-1] == "verdict: 2 of 4 planned check(s) FAILED  (30 s)"
    assert "passed" not in lines[-1]


def test_the_cpu_rows_verdict_counts_a_row_that_did_not_run_as_failed(monkeypatch, tmp_path):
    """``gpu-check --cpu`` words its verdict itself: a planned row with no outcome is one of the failed, and the
    line ends FAILED, as the exit status says (here every row but the last ran and passed; nothing starts)."""
    def all_but_the_last(planned, machine, deadline, echo=None, after=None):
        return [reporting.Outcome(c.name, c.kind, "skipped" if c.skip else "passed") for c in planned[:-1]]

    monkeypatch.setattr(checks, "run_all", all_but_the_last)
    rep = gpucheck.gpu_check(str(tmp_path / "report.json"), echo=False, cpu=True)
    c = rep["counts"]
    assert len(rep["not_run"]) == 1 and c["failed"] == 0 and c["passed"] >= 1 and gpucheck.exit_code(rep) == 1
    assert rep["verdict"] == f"CPU rows (no GPU used): {c['passed']} passed, 1 failed, {c['skipped']} not run -- FAILED"
    assert gpucheck.table(rep).splitlines()[-1].startswith(f"verdict: {rep['verdict']}  (")


def test_report_without_gpu_claims_nothing():
    rep = gpucheck.build(Machine(no_gpu_reason="CPU-only build"), [], [], 0.0, 1.0)
    assert rep["counts"]["passed"] == 0 and gpucheck.exit_code(rep) == 0
    assert rep["verdict"].startswith("no GPU: CPU-only build") and "no check passed" in rep["verdict"]
    assert "PASSED" not in gpucheck.table(rep)


def test_outcome_status_is_checked():
    with pytest.raises(ValueError):
        reporting.Outcome("x", "train", "ok")


def test_run_all_skips_and_budget(monkeypatch):
    ran = []
    monkeypatch.setitem(checks.RUNNERS, "train", lambda c, m: ran.append(c.name) or
                        reporting.Outcome(c.name, c.kind, "passed"))
    monkeypatch.setitem(checks.RUNNERS, "fault", lambda c, m: 1 / 0)
    plan = [gpucheck.Check("a", "train"), gpucheck.Check("b", "train", skip="no bf16 here"),
            gpucheck.Check("c", "fault"), gpucheck.Check("d", "train")]
    import time

    outs = checks.run_all(plan, Machine(), deadline=time.time() + 60, echo=None)
    assert [(o.name, o.status) for o in outs] == [("a", "passed"), ("b", "skipped"), ("c", "failed"), ("d", "passed")]
    assert "ZeroDivisionError" in outs[2].error and ran == ["a", "d"]
    late = checks.run_all(plan[:1], Machine(), deadline=time.time() - 1, echo=None)
    assert late[0].status == "failed" and "budget" in late[0].error


# ---- reading the machine without the CUDA driver ------------------------------------------------

def test_plan_takes_the_gpus_as_stnb_hardware_describes_them():
    """hardware.gpus() gives compute capability as a (major, minor) tuple (tests/test_gpu_sim.py reads it
    from a stand-in nvidia-smi); the plan refuses bf16 on a T4 given that shape."""
    t4 = {"index": 1, "name": "Tesla T4", "memory_bytes": 15360 * 2 ** 20, "compute_capability": (7, 5),
          "uuid": None}
    assert "single bf16" in {c.name for c in gpucheck.plan(Machine(gpus=[t4], arch_list=ARCH)) if c.skip}
    assert not planning.unsupported(Machine(gpus=[t4], arch_list=ARCH))
    assert planning.unsupported(Machine(gpus=[dict(t4, compute_capability=(6, 0))], arch_list=ARCH))


# ---- the real command, on this machine ----------------------------------------------------------

def _cli(tmp_path, **env):
    report = tmp_path / "gpu-check.json"
    out = subprocess.run([sys.executable, "-m", "stnb", "gpu-check", "--report", str(report)], capture_output=True,
                         text=True, timeout=180, env=dict(os.environ, **env))
    return out, json.loads(report.read_text()) if report.exists() else None


def test_cli_without_gpu_says_why_and_passes_nothing(tmp_path):
    import torch

    if torch.version.cuda and gpucheck.detect().gpus:
        pytest.skip("this machine has a GPU: run `make gpu-check`")
    out, rep = _cli(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "no GPU" in out.stdout and "Nothing was run; no check passed" in out.stdout
    if not torch.version.cuda:
        assert "CPU-only" in out.stdout and "TORCH_INDEX_URL" in out.stdout
    assert rep["counts"] == {"passed": 0, "failed": 0, "skipped": 0, "inconclusive": 0} and rep["outcomes"] == []
    assert rep["machine"]["no_gpu_reason"] and "PASSED" not in out.stdout


def test_cli_with_gpus_hidden(tmp_path):
    out, rep = _cli(tmp_path, STNB_FORCE_CPU="1")
    assert out.returncode == 0 and "STNB_FORCE_CPU=1" in out.stdout
    assert rep["counts"]["passed"] == 0


# ---- the RUN functions themselves, with gloo ranks on CPU (params['device'] = 'cpu') -------------

@pytest.mark.parametrize("fault,kind", [("raise", "raised"), ("kill", "killed"), ("stall", "stalled")])
def test_fault_checks_run_for_real_on_cpu(fault, kind):
    check = gpucheck.Check(f"fault {fault}", "fault", {"fault": fault, "nproc": 2, "device": "cpu"}, gpus=2)
    out = checks.RUNNERS["fault"](check, Machine())
    assert out.status == "passed", out.error
    assert out.metrics["processes_left"] == 0 and out.metrics["time_to_error_s"] < planning.FAULT_TO_ERROR_S


def test_fault_check_fails_when_the_fault_goes_unnoticed(monkeypatch):
    from stnblab.gpucheck import ranks

    monkeypatch.setitem(checks._FAULTS, "raise", (ranks.rank_pids, "raised"))  # a rank function that never faults
    check = gpucheck.Check("fault raise", "fault", {"fault": "raise", "nproc": 2, "device": "cpu"}, gpus=2)
    out = checks.RUNNERS["fault"](check, Machine())
    assert out.status == "failed" and "went unnoticed" in out.error


def _budget_row():
    return next(c for c in planning.cpu_plan(Machine()) if c.kind == "budget")


def test_the_memory_budget_check_on_cpu_trains_with_room_and_runs_out_under_the_tight_budget():
    """The budget's GPU row (the allocator's fraction) with gloo ranks here (RLIMIT_DATA): trained with room, then
    out of memory, named, under 16 MiB over what a rank's runtime held, no process left."""
    out = checks.RUNNERS["budget"](_budget_row(), Machine())
    assert out.status == "passed", out.error
    assert out.metrics["processes_left"] == 0
    assert "ran out of its memory budget" in out.detail and f"memory_budget_gib={out.metrics['budget_gib']:g}" \
        in out.detail


def test_the_memory_budget_check_fails_when_the_tight_run_trains(monkeypatch):
    monkeypatch.setattr(checks, "BUDGET_OVER_RUNTIME", 8 * 2**30)  # room enough: nothing runs out
    out = checks.RUNNERS["budget"](_budget_row(), Machine())
    assert out.status == "failed" and "the budget was not enforced" in out.error


def test_one_rank_fsdp_and_allreduce_checks_on_cpu():
    p = dict(planning.TRAIN, model="tiny", steps=3, warmup_steps_excluded=1, per_device_batch_size=4,
             max_seq_length=32, train_size=64, dev_size=16, device="cpu")
    out = checks.RUNNERS["train_direct"](gpucheck.Check("fsdp x1", "train_direct",
                                                        dict(p, strategy="fsdp", num_processes=1)), Machine())
    assert out.status == "passed", out.error
    assert "FSDP" in out.detail and "gloo" in out.detail and out.metrics["samples_per_second"] > 0
    ar = checks.RUNNERS["allreduce"](gpucheck.Check("ar", "allreduce", {"nproc": 2, "device": "cpu"}), Machine())
    assert ar.status == "passed" and "sum 3" in ar.detail


def test_ratio_check_runs_the_plain_script_and_stnb_on_cpu():
    p = dict(planning.RATIO, model="tiny", steps=6, warmup_steps_excluded=2, per_device_batch_size=4,
             max_seq_length=32, train_size=64, device="cpu", mixed_precision="no", goal=0.0, repeats=1)
    before = os.environ.get("STNB_TIME_SPLIT")
    out = checks.RUNNERS["ratio"](gpucheck.Check("ratio", "ratio", dict(p, strategy="single")), Machine())
    assert out.status == "passed", out.error
    m = out.metrics
    assert m["plain_runs"][0] > 0 and m["stnb_runs"][0] > 0
    # like with like: both trainers logged (read the loss of) every step, as stnb's recipe does
    assert m["logged_steps"]["plain"] == m["logged_steps"]["stnb"] == [p["steps"]]
    # the ratio is of median step times over the measured steps, not of one run's mean
    measured = p["steps"] - p["warmup_steps_excluded"]
    assert m["measured_steps"] == {"plain": measured, "stnb": measured, "stnb_split_off": measured}
    assert m["ratio"] == pytest.approx(m["samples_per_second"] / m["plain_samples_per_second"])
    # the third arm: stnb with its time split off, so a gap can be told apart from the split's own cost
    assert m["split_off_ratio"] == pytest.approx(m["split_off_samples_per_second"] / m["plain_samples_per_second"])
    assert m["logged_steps"]["stnb_split_off"] == [p["steps"]] and "time split off" in out.detail
    assert m["time_split_methods"] == {"stnb": "clock readings (CPU)", "stnb_split_off": "off (STNB_TIME_SPLIT=off)"}
    assert os.environ.get("STNB_TIME_SPLIT") == before
    assert m["noise"] is None and all(len(v) == 1 for v in m["run_median_steps"].values())  # one run per arm


def test_a_ratio_inside_its_runs_noise_is_inconclusive_never_passed():
    """The H200's three ratio rows (2026-11-26, the mpnet-base shape, 2 runs per arm): identical runs' median
    steps differed by up to 57%, so 0.993, 0.836 and 1.167 say nothing about a 0.98 goal."""
    assert checks.ratio_noise({"plain": [0.08, 0.10], "stnb": [0.09, 0.09]}) == pytest.approx(0.25)
    assert checks.ratio_noise({"plain": [0.08], "stnb": [0.09, 0.09]}) is None  # an arm ran once: unknown
    assert checks.ratio_verdict(0.993, 0.12, 0.98)[0] == "inconclusive"
    assert checks.ratio_verdict(0.836, 0.57, 0.98)[0] == "inconclusive"
    assert checks.ratio_verdict(1.167, 0.21, 0.98)[0] == "inconclusive"
    assert checks.ratio_verdict(1.0, 0.01, 0.98) == ("passed", "")  # 1.0 / 1.01 >= 0.98
    status, error = checks.ratio_verdict(0.9, 0.05, 0.98)  # 0.9 * 1.05 < 0.98: a gap beyond the noise
    assert status == "failed" and "beyond the runs' noise of 5.0%" in error
    assert checks.ratio_verdict(0.99, None, 0.98)[0] == "inconclusive"
    assert checks.ratio_verdict(0.5, None, 0.0) == ("passed", "")  # the CPU row's goal: only that it runs
    O = gpucheck.Outcome
    rep = gpucheck.report.build(Machine(gpus=[{"index": 0}]), [], [O("a", "train", "passed"), O("r", "ratio", "inconclusive")],
                                0.0, 1.0)
    assert rep["counts"]["inconclusive"] == 1 and gpucheck.exit_code(rep) == 1
    assert rep["verdict"] == "1 check(s) passed, 1 INCONCLUSIVE (the measurement could not decide: see its row)"


def test_gpu_check_watches_who_starts_cuda_from_its_start(monkeypatch, tmp_path):
    """Seen on the first GPU run: `python -m stnb gpu-check` imported torch after stnb, so nothing watched
    CUDA's start and the refusal could not name the call that made it. gpu_check turns the watcher on first
    (here with a budget already spent: no row runs)."""
    from stnb.processes import forksafe

    monkeypatch.setitem(forksafe._watch, "on", False)
    rep = gpucheck.gpu_check(str(tmp_path / "report.json"), budget_s=-1, echo=False, cpu=True)
    assert forksafe._watch["on"]
    assert rep["outcomes"] and all("not started" in o["error"] for o in rep["outcomes"] if o["status"] == "failed")
