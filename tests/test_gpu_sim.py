"""The GPU path on a machine without GPUs: what the libraries do on a GPU box is simulated, stnb is not.

The simulation (fixture ``gpu_box``) gives this CPU torch what a CUDA build on a GPU machine has:
``torch.version.cuda``, the compiled arch list, NVML answering with N GPUs (torch's own NVML
reader, which honours CUDA_VISIBLE_DEVICES) and an ``nvidia-smi`` on PATH. The CUDA driver's entry
points (``torch._C._cuda_getDeviceCount``, ``torch._C._cuda_init``, ``torch.cuda._lazy_init``)
record the call and raise in this process (the "notebook"); in forked ranks they answer like a
driver that sees no GPU (the ranks here run on CPU). ``torch.cuda.is_available()`` and
``torch.cuda.device_count()`` are torch's real functions, running on top of that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# The training stack is imported before any simulation starts: a real CUDA build has the rest of
# torch._C's CUDA bindings (torch._dynamo imports some when torch looks CUDA-compiled); this one has not.
import sentence_transformers.sentence_transformer.evaluation  # noqa: F401,E402
import sentence_transformers.sentence_transformer.losses  # noqa: F401,E402
import torch._dynamo  # noqa: F401,E402
import transformers.trainer  # noqa: F401,E402

import stnb
from stnb import hardware
from stnb.errors import ConfigError, StrategyUnavailable

T4 = ("Tesla T4", 15360, "GPU-7e1a", "7.5")
A100 = ("NVIDIA A100-SXM4-40GB", 40960, "GPU-a100", "8.0")
P100 = ("Tesla P100-PCIE-16GB", 16384, "GPU-9100", "6.0")
H100 = ("NVIDIA H100 80GB HBM3", 81559, "GPU-h100", "9.0")
CU128_ARCHS = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"   # a cu128-style build: no Pascal, no Volta
CU126_ARCHS = "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90"

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class GpuBox:
    def __init__(self):
        self.driver_calls = []


def _fake_smi(folder, gpus) -> None:
    """An nvidia-smi answering the queries stnb and accelerate make (index,name,memory,uuid[,compute_cap];
    count,name; driver_version)."""
    full = "\n".join(f"{i}, {n}, {m}, {u}, {cc}" for i, (n, m, u, cc) in enumerate(gpus))
    nocc = "\n".join(f"{i}, {n}, {m}, {u}" for i, (n, m, u, cc) in enumerate(gpus))
    count = "\n".join(f"{len(gpus)}, {n}" for n, *_ in gpus)
    script = "\n".join([
        "#!/bin/sh",
        'case "$*" in',
        f"  *compute_cap*) printf '%s\\n' \"{full}\" ;;",
        f"  *count,name*) printf '%s\\n' \"{count}\" ;;",
        "  *driver_version*) echo 570.00 ;;",
        f"  *index,name*) printf '%s\\n' \"{nocc}\" ;;",
        '  *) echo "fake nvidia-smi: unsupported query $*" >&2; exit 2 ;;',
        "esac", ""])
    path = os.path.join(folder, "nvidia-smi")
    with open(path, "w") as f:
        f.write(script)
    os.chmod(path, 0o755)


@pytest.fixture
def gpu_box(monkeypatch, tmp_path):
    """Returns a function gpu_box(gpus, archs=CU128_ARCHS) that turns this process into a simulated
    CUDA machine; box.driver_calls lists every CUDA driver entry point this process reached."""
    box = GpuBox()
    parent = os.getpid()

    def driver(name, in_rank):
        def call(*args, **kwargs):
            if os.getpid() != parent:  # a forked CPU rank: a driver that sees no GPU
                return in_rank
            box.driver_calls.append(name)
            raise RuntimeError(f"simulated GPU box: {name} starts the CUDA driver in the notebook process")
        return call

    def make(gpus, archs=CU128_ARCHS):
        _fake_smi(str(tmp_path), gpus)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.delenv("STNB_FORCE_CPU", raising=False)
        monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        # the build's architectures: asked in a child process (stnb.hardware._arch_list_of, which this
        # box answers); in this process torch's own reader marks forked children as CUDA's (seen on an
        # H200 with torch 2.11: "Cannot re-initialize CUDA in forked subprocess"), so it counts as a driver call
        monkeypatch.setattr(hardware, "_arch_list_of", lambda python: tuple(archs.split()))
        monkeypatch.setattr(torch._C, "_cuda_getArchFlags", driver("cudaGetArchFlags (marks forked children)", archs),
                            raising=False)
        monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", driver("cudaGetDeviceCount", 0), raising=False)
        monkeypatch.setattr(torch._C, "_cuda_init", driver("cuInit", None), raising=False)
        monkeypatch.setattr(torch.cuda, "_lazy_init", driver("torch.cuda._lazy_init", None))
        # NVML, as torch reads it (libnvidia-ml): the physical GPUs
        monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: len(gpus))
        monkeypatch.setattr(torch.cuda, "_raw_device_uuid_nvml", lambda: [u for _, _, u, _ in gpus])
        return box

    return make


def test_simulation_is_what_torch_sees(gpu_box):
    """The simulated box behaves like the real one: the NVML check counts GPUs, the default check
    reaches the driver (the call stnb used to make)."""
    box = gpu_box([T4, T4])
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2
    finally:
        del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
    assert box.driver_calls == []
    with pytest.raises(RuntimeError, match="simulated GPU box"):
        torch.cuda.is_available()
    assert box.driver_calls == ["cudaGetDeviceCount"]


def test_no_stnb_call_in_the_notebook_reaches_the_driver(gpu_box, tmp_path, capsys):
    """Everything a notebook calls before its ranks fork: setup, hardware, validate, bench planning,
    widgets, launch (2 forked ranks) and run. None of it may start the CUDA driver."""
    box = gpu_box([A100, A100])
    prof = stnb.setup(show=True)
    hw = stnb.hardware_report()
    assert hw.device == "cuda" and hw.gpus == [A100[0]] * 2 and hw.max_processes == 2
    assert hw.runnable("dp") and hw.runnable("ddp")
    assert "A100" in capsys.readouterr().out
    for strategy in ("single", "dp", "ddp", "fsdp"):
        cfg = prof.config(strategy=strategy, mixed_precision="bf16").validate()
        assert cfg.resolved_device() == "cuda"
    assert prof.config(strategy="ddp").world_size() == 2
    from stnblab import bench

    items = bench.plan(bench.BenchOptions.from_preset("quick"))
    assert items and all(it.config.device == "cuda" for it in items)
    from stnb import widgets

    panel = widgets.Panel(train_size=64)
    assert panel.device == "cuda" and panel.max_processes == 2
    ranks = stnb.launch(os.getpid, num_processes=2, device="cpu", echo=False)
    assert len(set(ranks)) == 2 and os.getpid() not in ranks
    result = stnb.run(strategy="single", device="cpu", model="tiny", steps=3, warmup_steps_excluded=1,
                      train_size=32, dev_size=8, evaluate=False, per_device_batch_size=4, echo=False)
    assert result.status == "ok" and len(result.losses) == 3
    assert box.driver_calls == []


def test_gpus_api_honours_cuda_visible_devices(gpu_box, monkeypatch):
    gpu_box([T4, A100, P100], archs=CU126_ARCHS)
    assert [g["name"] for g in hardware.gpus()] == [T4[0], A100[0], P100[0]]
    g = hardware.gpus()[1]
    assert g == {"index": 1, "name": A100[0], "memory_bytes": 40960 * 2**20, "compute_capability": (8, 0),
                 "uuid": "GPU-a100"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert [(g["index"], g["name"]) for g in hardware.gpus()] == [(0, P100[0]), (1, T4[0])]
    assert hardware.gpu_count() == 2 == torch.cuda.device_count()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a1")
    assert [g["name"] for g in hardware.gpus()] == [A100[0]] and hardware.gpu_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hardware.gpus() == [] and hardware.gpu_count() == 0 and hardware.default_device() == "cpu"


def test_gpu_count_falls_back_to_nvidia_smi_without_nvml(gpu_box, monkeypatch):
    box = gpu_box([T4, T4, T4])

    def no_nvml():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", no_nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    assert hardware.gpu_count() == 2
    assert box.driver_calls == []


def test_single_pins_one_gpu_in_its_rank(gpu_box, monkeypatch):
    """run(strategy='single') pins the rank to the first visible GPU through CUDA_VISIBLE_DEVICES, set in
    the child before CUDA starts there; the rank then sees one GPU."""
    box = gpu_box([A100, A100, A100])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    env = hardware.single_gpu_env()
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}

    def seen():
        return os.environ["CUDA_VISIBLE_DEVICES"], torch.cuda.device_count(), hardware.gpu_count()

    [inside] = stnb.launch(seen, num_processes=1, device="cuda", distributed=False, env=env, echo=False)
    assert inside == ("2", 1, 1)
    assert box.driver_calls == []


def test_ddp_and_zero1_on_one_gpu_are_refused_before_launch(gpu_box):
    """accelerate does not wrap one CUDA process in DDP: asked for (num_processes=1) or the default on a one-GPU
    machine, ddp and zero1 are refused with the fix; two GPUs, or one process on CPU, run."""
    gpu_box([A100])
    for strategy in ("ddp", "zero1"):
        for asked in (dict(num_processes=1, device="cuda"), dict(device="auto")):
            with pytest.raises(ConfigError, match=f"strategy '{strategy}' with one process on a GPU.*strategy='single'"):
                stnb.TrainConfig(strategy=strategy, model="tiny", **asked).validate(check_resources=False)
        stnb.TrainConfig(strategy=strategy, model="tiny", num_processes=1, device="cpu").validate(check_resources=False)
    stnb.TrainConfig(strategy="deepspeed", model="tiny", num_processes=1, device="cuda").validate(check_resources=False)
    gpu_box([A100, A100])
    for strategy in ("ddp", "zero1"):
        stnb.TrainConfig(strategy=strategy, model="tiny", device="auto").validate(check_resources=False)


def _gpu_this_rank_took():
    import torch.distributed as dist

    return dist.get_backend(), os.environ.get("STNB_TEST_SET_DEVICE"), stnb.rank_context().device


def test_two_ranks_share_one_gpu_over_gloo_only_when_asked(gpu_box, monkeypatch):
    """share_gpus=True (issue 47): more ranks than GPUs, each on GPU local_rank % GPUs (hardware.rank_gpu,
    accelerate's rule) and over gloo, since NCCL refuses two ranks on one device. Without it the launch is
    refused with that fix. Real forked ranks on the simulated one-GPU box: torch.cuda.set_device, which this
    CPU build lacks, records in each rank the GPU the rank picked."""
    gpu_box([A100])
    with pytest.raises(ConfigError, match="more than this machine supports for cuda.*share_gpus=True"):
        stnb.launch(_gpu_this_rank_took, num_processes=2, device="cuda", echo=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: os.environ.__setitem__("STNB_TEST_SET_DEVICE", str(d)))
    got = stnb.launch(_gpu_this_rank_took, num_processes=2, device="cuda", share_gpus=True, echo=False)
    assert got == [("gloo", "0", "cuda"), ("gloo", "0", "cuda")]


def test_share_gpus_lets_a_strategy_run_on_fewer_gpus_than_ranks(gpu_box):
    """What the config, the availability table and the backend say with GPUs shared: ddp on one GPU runs 2 ranks
    over gloo with share_gpus and is refused (offering it) without; with one rank per GPU nothing changes."""
    from stnb.config import TrainConfig

    gpu_box([A100])
    plain = TrainConfig(strategy="ddp", model="tiny", device="cuda", num_processes=2)
    with pytest.raises(StrategyUnavailable, match="1 GPU.*share_gpus=True runs several gloo ranks on each GPU"):
        plain.check_hardware()
    shared = TrainConfig(strategy="fsdp", model="tiny", device="cuda", share_gpus=True)
    assert shared.world_size() == 2  # the default with a GPU to share: two ranks, not the one GPU's one
    shared.check_hardware()
    reason = hardware.strategy_availability("cuda", share_gpus=True)["fsdp"]["reason"]
    assert "sharing 1 GPU(s), backend gloo" in reason
    assert not hardware.strategy_availability("cuda")["fsdp"]["runnable"]
    cores = hardware.cpu_cores()
    with pytest.raises(ConfigError, match="at most one gloo rank per core"):
        shared.replace(num_processes=cores + 1).check_hardware()
    gpu_box([A100, A100])
    assert (hardware.backend_for("cuda", 2), hardware.backend_for("cuda", 3), hardware.backend_for("cpu", 2)) == (
        "nccl", "gloo", "gloo")
    assert [hardware.rank_gpu(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    assert TrainConfig(strategy="ddp", model="tiny", device="cuda", share_gpus=True).world_size() == 2


def test_every_rank_picks_its_gpu_by_one_rule():
    """The GPU of a rank is chosen in one place (hardware.rank_gpu): no other code in stnb or the lab makes
    'cuda:{local rank}' or sets the device from the local rank itself (a second rule would put a rank sharing
    a GPU on a GPU that does not exist: 'invalid device ordinal', seen on the H200)."""
    import re

    bad = re.compile(r"cuda:\{(local|local_rank|ctx\.local_rank)\}|set_device\((local_rank|local)\)")
    found = [f"{p.relative_to(ROOT)}:{n}" for folder in ("stnb", "stnblab") for p in sorted((Path(ROOT) / folder).rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert found == []


def test_bf16_on_a_t4_is_refused_with_the_fix(gpu_box):
    gpu_box([T4])
    with pytest.raises(ConfigError) as e:
        stnb.TrainConfig(strategy="single", model="tiny", device="cuda", mixed_precision="bf16").validate()
    assert "7.5" in str(e.value) and "mixed_precision='fp16'" in str(e.value)
    stnb.TrainConfig(strategy="single", model="tiny", device="cuda", mixed_precision="fp16").validate()
    gpu_box([A100])
    stnb.TrainConfig(strategy="single", model="tiny", device="cuda", mixed_precision="bf16").validate()


def test_gpus_of_one_model_share_one_problem_line(gpu_box):
    """Kaggle's 2x T4 with bf16: one refusal naming both GPUs, not the same sentence twice; a mixed box keeps a
    line per model (the T4s together, the P100 alone)."""
    gpu_box([T4, T4])
    assert hardware.gpu_problems("bf16") == [
        "mixed_precision='bf16' needs compute capability >= 8.0 (Ampere or newer); GPUs 0, 1 (Tesla T4) are 7.5, "
        "where bf16 is emulated and slow. Fix: use mixed_precision='fp16' (or 'no') on these GPUs"]
    assert hardware.gpu_problems("fp16") == []
    gpu_box([T4, A100, T4, P100], archs=CU126_ARCHS)  # a build with sm_60: the P100 runs, without bf16
    problems = hardware.gpu_problems("bf16")
    assert [p.split("; ")[1].split(" (")[0] for p in problems] == ["GPUs 0, 2", "GPU 3"], problems
    assert "GPU 3 (Tesla P100-PCIE-16GB) is 6.0" in problems[1] and problems[1].endswith("on this GPU")


def test_p100_without_kernels_in_this_torch_build(gpu_box):
    """A P100 (sm_60) with a build that ships sm_75+: not usable. auto falls back to CPU with a warning
    naming the fix; device='cuda' is refused. With a build that ships sm_60 it is usable."""
    gpu_box([P100])
    hw = stnb.hardware_report()
    assert hw.device == "cpu" and hw.gpus == [P100[0]]
    assert any("sm_60" in w and "device='cpu'" in w for w in hw.warnings)
    assert "warning:" in str(hw)
    with pytest.raises(ConfigError, match="no kernels in this torch build"):
        stnb.TrainConfig(strategy="single", model="tiny", device="cuda").validate()
    gpu_box([P100], archs=CU126_ARCHS)
    assert stnb.hardware_report().device == "cuda" and stnb.hardware_report().warnings == []
    stnb.TrainConfig(strategy="single", model="tiny", device="cuda").validate()


def test_arch_compatibility_rules():
    assert hardware.arch_supported((8, 6), ["sm_80"])          # same major, newer minor: the cubin runs
    assert not hardware.arch_supported((8, 0), ["sm_86"])      # an older minor cannot run it
    assert not hardware.arch_supported((6, 0), CU128_ARCHS.split())
    assert hardware.arch_supported((7, 5), ["sm_80", "compute_70"])  # PTX JIT-compiles upwards
    assert hardware.arch_supported((12, 0), ["sm_90a", "sm_120"])


def test_bench_on_one_gpu_compares_on_cpu_ranks(gpu_box):
    """Notebook 05 / bench with device auto on 1 GPU: DDP needs 2 ranks, so the plan runs on CPU ranks
    (as notebooks 00/03/04/06 do) and every DDP variant is runnable; device='cuda' marks them not runnable."""
    from stnblab import bench

    gpu_box([T4])
    opts = bench.BenchOptions.from_preset("quick", sections=("knobs",))
    device, note = bench.bench_device(opts)
    assert device == "cpu" and "CPU ranks" in note
    items = bench.plan(opts)
    ddp = [it for it in items if it.config.strategy == "ddp"]
    assert ddp and all(it.unavailable is None for it in ddp)
    assert all(it.config.device == "cpu" for it in items)
    on_gpu = bench.plan(bench.BenchOptions.from_preset("quick", sections=("knobs",), device="cuda"))
    assert all("needs at least 2 ranks" in (it.unavailable or "") for it in on_gpu if it.config.strategy == "ddp")
    assert any(it.unavailable is None for it in on_gpu if it.config.strategy == "single")


# ---- the driver started by user code: check_fork_safe sees it ------------------------------------

FAKE_DRIVER = r"""
static int initialised = 0;
int cuInit(unsigned int flags) { (void)flags; initialised = 1; return 0; }
int cuDeviceGetCount(int *n) { if (!initialised) return 3; *n = 1; return 0; }  /* 3: NOT_INITIALIZED */
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a stand-in libcuda.so.1")
def test_check_fork_safe_sees_a_driver_started_by_is_available(tmp_path):
    """A cell calls torch.cuda.is_available(): torch's cudaGetDeviceCount loads libcuda and runs cuInit,
    torch.cuda.is_initialized() stays False. stnb.launch must refuse before forking. The driver is a
    stand-in shared library (cuInit / cuDeviceGetCount), in a subprocess so it never loads here."""
    src = tmp_path / "cuda.c"
    src.write_text(FAKE_DRIVER)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)], check=True)
    script = textwrap.dedent(f"""
        import ctypes, json, torch
        import stnb
        from stnb.processes import forksafe
        out = {{"before_load": forksafe.cuda_driver_initialised()}}
        def cuda_get_device_count():  # what torch's cudaGetDeviceCount does: load the driver, cuInit
            driver = ctypes.CDLL({str(lib)!r})
            driver.cuInit(0)
            return 1
        torch._C._cuda_getDeviceCount = cuda_get_device_count
        torch.version.cuda = "12.8"
        out["loaded_not_started"] = forksafe.cuda_driver_initialised() if ctypes.CDLL({str(lib)!r}) else None
        out["is_available"] = torch.cuda.is_available()          # the user's cell
        out["torch_flag"] = torch.cuda.is_initialized()
        out["after"] = forksafe.cuda_driver_initialised()
        try:
            stnb.launch(lambda: 1, num_processes=2, device="cpu", echo=False)
            out["launch"] = "forked"
        except stnb.ConfigError as e:
            out["launch"] = str(e)
        print(json.dumps(out))
        """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before_load"] is False and out["loaded_not_started"] is False
    assert out["is_available"] is True and out["torch_flag"] is False   # what the old check looked at
    assert out["after"] is True
    assert "CUDA is already initialised" in out["launch"] and "restart the kernel" in out["launch"]


# ---- Colab: notebook_launcher would run the rank inside the kernel ----------------------------------

COLAB_KERNEL = r"""
import importlib.machinery, json, os, sys, types
from IPython.core.interactiveshell import InteractiveShell

# a Colab kernel as accelerate recognises one: "google.colab" in str(get_ipython())
google, colab, shell_mod = (types.ModuleType(n) for n in ("google", "google.colab", "google.colab._shell"))
for m in (google, colab, shell_mod):
    m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
class Shell(InteractiveShell):
    pass
Shell.__module__ = "google.colab._shell"
shell_mod.Shell = Shell
sys.modules.update({"google": google, "google.colab": colab, "google.colab._shell": shell_mod})
shell = Shell.instance()
import IPython
assert "google.colab" in str(sys.modules["IPython"].get_ipython())

import stnb
kernel_pid, stdout, fd1 = os.getpid(), sys.stdout, os.fstat(1).st_ino

def rank():
    ctx = stnb.rank_context()
    return {"rank": ctx.rank, "pid": os.getpid(), "world_size": ctx.world_size}

ranks = stnb.launch(rank, num_processes=2, device="cpu", echo=False)
print(json.dumps({"ranks": ranks, "kernel_pid": kernel_pid, "shell_kept": IPython.get_ipython() is shell,
                  "stdout_kept": sys.stdout is stdout and os.fstat(1).st_ino == fd1}))
"""


def test_colab_kernel_never_runs_a_rank(tmp_path):
    """In Colab with fewer than 2 GPUs notebook_launcher calls the function in the kernel; stnb then
    redirected the kernel's output, cleared its shell and SIGKILLed it. The 'kernel' here is a subprocess
    with a Colab-like IPython shell: it must get two forked ranks' results and survive untouched."""
    proc = subprocess.run([sys.executable, "-c", COLAB_KERNEL], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT}, cwd=str(tmp_path))
    assert proc.returncode == 0, f"the kernel died (exit {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["rank"] for r in out["ranks"]] == [0, 1] and {r["world_size"] for r in out["ranks"]} == {2}
    pids = {r["pid"] for r in out["ranks"]}
    assert len(pids) == 2 and out["kernel_pid"] not in pids
    assert out["shell_kept"] and out["stdout_kept"]


# ---- dp with mixed precision: the Trainer's DataParallel path ----------------------------------------

def _dp_trainer_dtypes(output_dir: str) -> dict:
    """In a rank: a sentence-transformers trainer with bf16, transformers told it sees 2 GPUs, prepared
    for 'dp' the way stnb's training does (the dp strategy's prepare)."""
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer import losses

    from stnb import strategies
    from stnb.data import load_pairs
    from stnb.models import load_model, resolve_model

    model = load_model(resolve_model("tiny"), device="cpu", max_seq_length=32)
    seen = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda m, i, out: seen.append(str(out.dtype)))
    train, _ = load_pairs("synthetic", 32, 8, 0)
    args = SentenceTransformerTrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=4, max_steps=2, use_cpu=True, bf16=True,
        report_to="none", save_strategy="no", disable_tqdm=True)
    n_gpu_here = args.n_gpu
    args._n_gpu = 2
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train,
                                         loss=losses.CosineSimilarityLoss(model))
    applied = strategies.get("dp").prepare(trainer, None, "cpu", 1)["info"]["dp_autocast"]
    trainer.train()
    return {"n_gpu_here": n_gpu_here, "data_parallel": isinstance(trainer.model_wrapped, torch.nn.DataParallel),
            "dtypes": sorted(set(seen)), "calls": len(seen), "applied": applied}


def test_dp_trains_under_the_requested_precision(tmp_path):
    """transformers wraps nn.DataParallel itself when args.n_gpu > 1 and then skips accelerate's
    prepare_model, where autocast lives: dp with bf16 trained in fp32. Here transformers is told it sees
    2 GPUs (args._n_gpu, what TrainingArguments._setup_devices sets on such a machine); on CPU
    DataParallel calls the module directly, through the same Trainer code path. The dtype is observed
    inside the forward. (In a forked rank: a Trainer in this process would make it unfit to fork.)"""
    [out] = stnb.launch(_dp_trainer_dtypes, str(tmp_path), num_processes=1, device="cpu", distributed=False,
                        echo=False)
    assert out["n_gpu_here"] == 0 and out["data_parallel"]
    assert out["calls"] > 0 and out["dtypes"] == ["torch.bfloat16"] and out["applied"] == "bf16"


def test_dp_replicas_autocast_in_their_own_threads(monkeypatch):
    """On GPUs DataParallel runs each replica in a worker thread (torch.nn.parallel.parallel_apply), which
    re-enters autocast without a dtype; the autocast dtype is per thread, so an outer fp16/bf16 context
    does not carry over. Simulated on CPU with torch's own worker logic: each replica in a new thread
    under ``torch.amp.autocast(device, enabled=<outer state>)``."""
    import threading

    from stnb import strategies

    def threaded_parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
        enabled = torch.is_autocast_enabled("cpu")
        results = [None] * len(modules)

        def worker(i):
            with torch.amp.autocast("cpu", enabled=enabled):
                results[i] = modules[i](*inputs[i], **(kwargs_tup[i] if kwargs_tup else {}))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(modules))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    import importlib

    monkeypatch.setattr(importlib.import_module("torch.nn.parallel.data_parallel"), "parallel_apply",
                        threaded_parallel_apply)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        dp = strategies.autocast_data_parallel(torch.nn.DataParallel(lin), precision)
        outs = dp.parallel_apply([lin, lin], [(x,), (x,)], [{}, {}])
        assert [o.dtype for o in outs] == [dtype, dtype]
    assert strategies.autocast_data_parallel(torch.nn.DataParallel(lin), "no").__class__ is torch.nn.DataParallel


# ---- peak memory: the training steps apart from the rest ----------------------------------------------

def test_training_peak_excludes_what_happens_after_training(tmp_path, monkeypatch):
    """Rank 0's work after training (evaluation, FSDP's gathered full copy, the save/reload) used to be in
    the per-rank peak. Here the library's SentenceTransformer.save allocates and touches 600 MiB, holds it
    for a second (the RSS sampler sees it), then saves: the whole-run peak shows it, the training peak not."""
    import time

    from sentence_transformers import SentenceTransformer

    big = 600 * 2**20
    real_save = SentenceTransformer.save

    def heavy_save(self, *args, **kwargs):
        block = torch.ones(big // 4, dtype=torch.float32)
        time.sleep(1.0)
        del block
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(SentenceTransformer, "save", heavy_save)
    result = stnb.run(strategy="single", device="cpu", model="tiny", steps=3, warmup_steps_excluded=1,
                      train_size=32, dev_size=8, evaluate=False, per_device_batch_size=4,
                      save_to=str(tmp_path / "model"), echo=False)
    assert result.verified and result.saved_to
    [train], [whole] = result.peak_memory_bytes, result.peak_memory_run_bytes
    assert 0 < train < big / 2
    assert whole - train >= big * 0.8


# ---- NCCL failure handling: the diagnosis names the rank that really failed ----------------------------
# Real 2-rank gloo launches; the ranks behave the way NCCL ranks do (a failing rank that cannot exit,
# a peer whose NCCL watchdog gives up on a collective).

NCCL_TIMEOUT = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
                "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600017 milliseconds before timing out.")


def _origin_cannot_exit():
    """Rank 0 raises, but its process cannot exit (as when destroy_process_group blocks under NCCL):
    rank 1 waits in the collective rank 0 never joins."""
    import threading
    import time as _time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        threading.Thread(target=_time.sleep, args=(3600,), daemon=False).start()
        raise ValueError("the real failure, on rank 0")
    dist.barrier()
    return 1


def _peer_gives_up_waiting():
    """Rank 0 is busy elsewhere; rank 1's NCCL watchdog times out the collective it waits in."""
    import time as _time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        _time.sleep(120)
        return 0
    _time.sleep(1.0)
    raise RuntimeError(NCCL_TIMEOUT)


def _raise_on_rank0_peer_waits():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("the real failure, on rank 0")
    dist.barrier()
    return 1


def test_diagnosis_names_the_origin_when_its_peers_hang():
    with pytest.raises(stnb.LaunchError) as e:
        stnb.launch(_origin_cannot_exit, num_processes=2, device="cpu", stall_timeout=3, timeout=180, echo=False)
    err = e.value
    assert err.rank == 0 and err.kind == "raised"
    assert str(err).startswith("rank 0 raised ValueError: the real failure, on rank 0")
    assert "ValueError" in err.rank_traceback


def test_diagnosis_treats_an_nccl_watchdog_timeout_as_a_consequence():
    with pytest.raises(stnb.LaunchError) as e:
        stnb.launch(_peer_gives_up_waiting, num_processes=2, device="cpu", stall_timeout=30, timeout=180,
                    echo=False)
    err = e.value
    assert err.rank == 0, str(err)
    assert "never joined the collective rank 1 waited in" in str(err) and "Watchdog caught" in str(err)


@pytest.mark.parametrize("message", [
    "NCCL error in: ProcessGroupNCCL.cpp:1935, remote process exited or there was a network error, NCCL version 2.27.3",
    NCCL_TIMEOUT,
    "Connection closed by remote peer 127.0.0.1:29500",
])
def test_nccl_messages_are_secondary(message):
    from stnb.processes import peerfail

    assert peerfail.is_secondary({"type": "RuntimeError", "message": message})
    assert not peerfail.is_secondary({"type": "ValueError", "message": "bad batch"})
    earlier = {"type": "RuntimeError", "message": message, "time": 1.0, "rank": 1}
    real = {"type": "ValueError", "message": "bad batch", "time": 2.0, "rank": 0}
    assert peerfail.origin([earlier, real]) is real


def test_failing_rank_never_calls_a_blocking_destroy_process_group(monkeypatch):
    """NCCL's destroy_process_group can block in a rank whose peers never finish their collectives.
    Simulated: the library's destroy_process_group never returns. The failing rank must still exit, so
    its peer is stopped long before the stall timeout and the error names rank 0."""
    import time as _time

    import torch.distributed as dist

    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: _time.sleep(3600))
    with pytest.raises(stnb.LaunchError) as e:
        stnb.launch(_raise_on_rank0_peer_waits, num_processes=2, device="cpu", stall_timeout=15, timeout=180,
                    echo=False)
    err = e.value
    assert err.rank == 0 and "ValueError" in str(err)
    assert err.kind == "raised" and "waited for it" not in str(err)


def test_nccl_ranks_get_a_bounded_timeout_and_async_error_handling(monkeypatch):
    from stnb.processes import peerfail

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert peerfail.nccl_env() == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert peerfail.collective_timeout(30).total_seconds() == peerfail.MIN_COLLECTIVE_TIMEOUT_S
    assert peerfail.collective_timeout(600).total_seconds() == 1200


# ---- issue 18: the GPU path, second reading ----------------------------------------------------------

def _rank_device():
    return stnb.rank_context().device


def test_launch_auto_skips_a_gpu_the_torch_build_cannot_run(gpu_box):
    """A P100 with a cu128-style build: hardware_report() says cpu, and stnb.launch(device='auto')
    must agree (it used to count GPUs only, and sent the function to a GPU without kernels)."""
    box = gpu_box([P100])
    assert stnb.hardware_report().device == "cpu"
    [device] = stnb.launch(_rank_device, num_processes=1, device="auto", distributed=False, echo=False)
    assert device == "cpu" and stnb.last_launch().device == "cpu"
    gpu_box([P100], archs=CU126_ARCHS)  # a build with sm_60 kernels: auto is the GPU
    assert stnb.launch(_rank_device, num_processes=1, device="auto", distributed=False, echo=False) == ["cuda"]
    assert box.driver_calls == []


def test_st_docs_on_one_gpu_runs_its_single_row_on_the_gpu(gpu_box, tmp_path):
    """bench --preset st-docs measures GPUs: on 1 GPU with device auto its single row runs there (dp / ddp /
    fsdp are listed as not runnable, with the reason); it used to run everything on CPU ranks. The gpu-check's
    st-docs row plans the same way."""
    from stnblab import bench
    from stnblab.gpucheck import checks, planning

    box = gpu_box([H100])
    items = bench.plan(bench.BenchOptions.from_preset("st-docs"))
    single = [it for it in items if it.config.strategy == "single"]
    assert single and all(it.config.device == "cuda" and it.unavailable is None for it in single)
    ddp = [it for it in items if it.config.strategy == "ddp"]
    assert ddp and all("needs at least 2" in (it.unavailable or "") for it in ddp)
    [row] = [c for c in planning.plan(planning.detect()) if c.kind == "st_docs"]
    opts = checks.st_docs_options(row, str(tmp_path))
    planned = bench.plan(opts)
    assert [(it.config.strategy, it.config.device, it.unavailable) for it in planned] == [("single", "cuda", None)]
    assert box.driver_calls == []


def test_plain_baseline_and_stnb_single_use_the_same_gpu(gpu_box, monkeypatch):
    """The gpu-check's ratio: with CUDA_VISIBLE_DEVICES=3 the plain script used to be pinned to visible
    ordinal 0 (physical GPU 0, an H100 here) while stnb.run(strategy='single') ran on physical GPU 3 (the
    A100). Each environment is applied and the GPU it leaves visible is read back."""
    from stnblab.gpucheck import gpubound

    box = gpu_box([H100, H100, H100, A100])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")

    def seen_with(env):
        with monkeypatch.context() as m:
            m.setenv("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"])
            return [(g["name"], g["uuid"]) for g in hardware.gpus()]

    stnb_gpu = seen_with(hardware.single_gpu_env())
    assert stnb_gpu == [(A100[0], A100[2])]
    assert seen_with(gpubound.plain_env("cuda")) == stnb_gpu
    assert gpubound.plain_env("cpu")["CUDA_VISIBLE_DEVICES"] == ""
    assert box.driver_calls == []


def _fsdp2_scaler_step():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8, bias=False)
    fully_shard(lin, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # what accelerate gives FSDP2 under fp16
    before = lin.weight.to_local().clone()
    scaler.scale(lin(torch.ones(2, 8)).sum()).backward()
    if dist.get_rank() == 1:
        lin.weight.grad.to_local()[0, 0] = float("inf")  # an overflow in rank 1's shard only
    scaler.step(opt)
    scaler.update()
    return {"scale": scaler.get_scale(), "stepped": not torch.equal(before, lin.weight.to_local())}


def test_fsdp2_grad_scaler_skips_an_overflow_on_every_rank():
    """The T4 rows train FSDP2 in fp16: accelerate gives FSDP2 torch's plain GradScaler (not the
    ShardedGradScaler). An inf in one rank's gradient shard must make every rank skip the step and halve
    the same scale, or the shards would step apart and the next reduce-scatter would mix two scales."""
    out = stnb.launch(_fsdp2_scaler_step, num_processes=2, device="cpu", echo=False)
    assert out == [{"scale": 512.0, "stepped": False}] * 2


def _sigterm_handler():
    import signal

    h = signal.getsignal(signal.SIGTERM)
    return "default" if h == signal.SIG_DFL else repr(h)


@pytest.mark.parametrize("nproc", [2, 1])
def test_a_rank_dies_of_sigterm_at_once(nproc):
    """torch elastic installs a Python SIGTERM handler before it forks the ranks, and forked ranks
    inherit it. A peer blocked in a CUDA / NCCL wait never returns to Python to run it, so when a rank
    fails, elastic's SIGTERM does nothing and its SIGKILL comes 30 s later. In a rank SIGTERM must kill."""
    assert stnb.launch(_sigterm_handler, num_processes=nproc, device="cpu", echo=False) == ["default"] * nproc


def _raise_while_peer_blocked_in_c():
    """Rank 1 raises; rank 0 waits in a C call that never returns to Python (a locked pthread mutex,
    locked again: a futex wait retried on EINTR, like a CUDA / NCCL wait)."""
    import ctypes
    import time as _time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        _time.sleep(0.5)
        raise ValueError("the real failure, on rank 1")
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER is all zeros
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
    return 0


def test_peer_blocked_in_c_is_stopped_and_the_raise_is_named():
    """torch elastic SIGTERMs the blocked peer, which now dies of it at once (see above): the error still
    names the rank that raised, not the peer the launcher stopped."""
    with pytest.raises(stnb.LaunchError) as e:
        stnb.launch(_raise_while_peer_blocked_in_c, num_processes=2, device="cpu", stall_timeout=120,
                    timeout=180, echo=False)
    err = e.value
    assert (err.rank, err.kind) == (1, "raised"), str(err)
    assert str(err).startswith("rank 1 raised ValueError: the real failure, on rank 1")


def _rank0_busy_then_barrier(how: str):
    """Rank 0 evaluates / saves for 4 s (heartbeating: it is working); rank 1 waits for it."""
    import time as _time

    import torch.distributed as dist

    from stnb.processes import wait_for_all

    if dist.get_rank() == 0:
        for _ in range(40):
            _time.sleep(0.1)
            stnb.heartbeat()
    try:
        wait_for_all() if how == "wait_for_all" else dist.barrier()
        return "arrived"
    except Exception as e:  # noqa: BLE001 - what the wait raised is the result
        return type(e).__name__


@pytest.mark.parametrize("how,arrives", [("barrier", False), ("wait_for_all", True)])
def test_waiting_for_rank0s_save_outlives_the_collective_timeout(monkeypatch, how, arrives):
    """NCCL ranks get a bounded collective timeout (peerfail.collective_timeout, 300 s), and rank 0's
    evaluation and save after training are waited for in a barrier: a large model's save could make the
    others' barrier abort after training finished. The bound is shortened to 1.5 s here (gloo ranks get
    it too): a plain barrier is cut short, stnb's wait_for_all (what training uses) is not."""
    import datetime

    from stnb.processes import rank as rank_module

    monkeypatch.setattr(rank_module, "collective_timeout", lambda stall: datetime.timedelta(seconds=1.5))
    out = stnb.launch(_rank0_busy_then_barrier, how, num_processes=2, device="cpu", echo=False, stall_timeout=60)
    assert (out[1] == "arrived") is arrives, out


def _predicted_failures(machine, plan, tmp) -> list:
    """Why a planned row that runs would fail on this (simulated) machine by construction, asked of the
    code the row itself goes through: TrainConfig.validate, the launch's capacity check, the precision
    check, bench's plan, and accelerate's DDP rule (more than one process)."""
    from stnblab import bench
    from stnblab.gpucheck import checks, planning

    why = []
    for c in plan:
        if c.skip:
            continue
        p, name = c.params, c.name
        try:
            if c.kind in ("train", "ratio"):
                checks.train_config(p).validate()
            if c.kind == "train_direct":
                why += [f"{name}: {x}" for x in hardware.gpu_problems(p["mixed_precision"])]
            n = p.get("nproc") or p.get("num_processes") or 1
            shared = bool(p.get("share_gpus"))  # a fault row with a peer on one GPU: two ranks share it
            if c.kind in ("allreduce", "fault", "train_direct") and hardware.capacity_problem("cuda", n, share_gpus=shared):
                why.append(f"{name}: {hardware.capacity_problem('cuda', n, share_gpus=shared)}")
            if p.get("strategy") == "ddp" and n < 2:
                why.append(f"{name}: accelerate does not wrap one process in DDP")
            if c.kind == "st_docs":
                items = bench.plan(checks.st_docs_options(c, tmp))
                if [(it.config.device, it.unavailable) for it in items] != [("cuda", None)]:
                    why.append(f"{name}: bench plans {[(it.name, it.config.device, it.unavailable) for it in items]}")
            if c.kind == "hardware" and planning.unsupported(machine):
                why.append(f"{name}: unsupported GPU")
            if c.kind == "notebook" and not os.path.isfile(p["path"]):
                why.append(f"{name}: no notebook at {p['path']}")
        except ConfigError as e:
            why.append(f"{name}: {e}")
    return why


@pytest.mark.parametrize("label,box", [("1x H100", [H100]), ("2x T4", [T4, T4]), ("1x T4", [T4])])
def test_gpu_check_plans_only_rows_that_can_pass(gpu_box, label, box, tmp_path, capsys):
    """`make gpu-check` on 1x H100, Kaggle's 2x T4 and 1x T4: the plan (printed by `gpu-check --plan`)
    lists the rows that will run, and none of them is bound to fail on that machine. docs/gpu.md's
    table gives the same count of rows that run."""
    from stnb.__main__ import main
    from stnblab.gpucheck import planning

    sim = gpu_box(box)
    machine = planning.detect()
    plan = planning.plan(machine)
    assert main(["gpu-check", "--plan"]) == 0
    printed = capsys.readouterr().out
    with capsys.disabled():
        print(f"\n{printed}")
    running = [c for c in plan if not c.skip]
    assert running and all(c.name in printed for c in plan)
    assert f"{len(running)} row(s) will run" in printed
    assert _predicted_failures(machine, plan, str(tmp_path)) == []
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        [row] = [line for line in f if line.startswith(f"| {label} |")]
    assert row.split("|")[2].strip().startswith(f"{len(running)}:"), row
    if len(box) == 2:  # the T4 pair trains dp / ddp / fsdp in fp16
        assert {"dp x2 fp16", "ddp x2 fp16", "fsdp x2 fp16"} <= {c.name for c in running}
    assert sim.driver_calls == []


def test_the_t4_table_is_what_stnbs_rules_say(gpu_box, monkeypatch):
    """Issue 32 item 2: what runs on Colab's 1x T4 and Kaggle's 2x T4 and why the rest is refused, in docs/gpu.md,
    is stnb's own rules asked on those machines simulated (``whatruns``: TrainConfig.validate per strategy and
    precision), never run on a T4. The runtimes have no DeepSpeed and stnb's install cell adds none; with it, and
    with a transformers older than fsdp / zero2 need (the GPU image's 5.17), the cells that change are listed.
    STNB_WRITE_DOCS=1 writes the table into docs/gpu.md instead of failing."""
    from stnb.strategies import deepspeed, fsdp
    from stnblab.gpucheck import whatruns

    def machines():
        out = {}
        for label, box in (("1x T4", [T4]), ("2x T4", [T4, T4])):
            gpu_box(box)
            out[label] = whatruns.what_runs()
        return out

    monkeypatch.setattr(deepspeed, "installed", lambda: False)
    runtime = machines()
    monkeypatch.setattr(deepspeed, "installed", lambda: True)
    with_deepspeed = machines()
    monkeypatch.setattr(deepspeed, "installed", lambda: False)
    monkeypatch.setattr(fsdp, "installed_transformers", lambda: "5.17.0")
    old_transformers = machines()
    body = whatruns.markdown(runtime, {
        'With DeepSpeed installed (`pip install "stnb[deepspeed]"`)': with_deepspeed,
        "With transformers older than 5.19 (the GPU image's 5.17)": old_transformers})
    path = os.path.join(ROOT, "docs", "gpu.md")
    if os.environ.get("STNB_WRITE_DOCS") == "1":
        whatruns.refresh(path, body)
    with open(path) as f:
        assert whatruns.block(f.read()) == body, ("docs/gpu.md's T4 table is not what stnb's rules say: "
                                                 "STNB_WRITE_DOCS=1 python -m pytest tests/test_gpu_sim.py -k t4_table")
    one, two = ({k: why or "" for k, why in runtime[label].items()} for label in ("1x T4", "2x T4"))
    assert one["single", "fp16"] == "" and "7.5" in one["single", "bf16"] and "at least 2" in one["dp", "fp16"]
    assert two["dp", "fp16"] == two["ddp", "fp16"] == "" and "7.5" in two["fsdp", "bf16"]
    assert "DeepSpeed" in two["deepspeed", "fp16"] and with_deepspeed["2x T4"]["deepspeed", "fp16"] is None
    old = old_transformers["2x T4"]
    assert "5.19" in (old["fsdp", "fp16"] or "") and old["ddp", "fp16"] is None


# ---- the notebook's order: the GPU box first, then the imports -----------------------------------

NOTEBOOK_ORDER = r"""
import importlib, json, os, sys
import torch   # a CUDA build of torch on a GPU machine, from here on; only then the rest is imported

parent, calls = os.getpid(), []

def driver(name, in_rank=None):
    def call(*args, **kwargs):
        if os.getpid() != parent:  # a forked CPU rank: a driver that sees no GPU
            return in_rank
        calls.append(name)
        raise RuntimeError(f"simulated GPU box: {name} starts the CUDA driver in the notebook process")
    return call

torch.version.cuda = "12.8"
torch._C._cuda_getArchFlags = driver("cudaGetArchFlags (marks forked children)", "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120")
torch._C._cuda_getDeviceCount = driver("cudaGetDeviceCount", 0)
torch._C._cuda_init = driver("cuInit")
torch.cuda._lazy_init = driver("torch.cuda._lazy_init")
# a binding a CUDA build's torch._C has, which torch._dynamo imports (by name) once torch looks CUDA-built
torch._C._cuda_getCurrentRawStream = driver("cudaGetCurrentRawStream")
torch.cuda._raw_device_count_nvml = lambda: 1
torch.cuda._raw_device_uuid_nvml = lambda: ["GPU-h100"]

steps = {}
def step(name, fn):
    try:
        fn()
        steps[name] = "ok"
    except Exception as e:  # what failed, and where
        steps[name] = f"{type(e).__name__}: {e}"[:400]

step("import stnb", lambda: importlib.import_module("stnb"))
import stnb
import stnb.hardware
# the build's architectures, as the child process stnb asks would answer
stnb.hardware._arch_list_of = lambda python: ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
step("stnb.setup()", stnb.setup)
step("hardware_report", lambda: stnb.hardware_report().device == "cuda" or 1 / 0)
for mod in ("sentence_transformers", "sentence_transformers.sentence_transformer.losses",
            "sentence_transformers.sentence_transformer.evaluation", "transformers.trainer", "accelerate",
            "stnb.widgets", "stnblab.bench", "stnblab.gpucheck"):
    step(f"import {mod}", lambda mod=mod: importlib.import_module(mod))
step("validate", lambda: stnb.TrainConfig(strategy="single", model="tiny", device="cuda",
                                          mixed_precision="bf16").validate())
gpucheck = lambda: importlib.import_module("stnblab.gpucheck")
step("gpu-check plan", lambda: gpucheck().plan(gpucheck().detect()))
step("run on CPU ranks", lambda: stnb.run(strategy="single", device="cpu", model="tiny", steps=2,
                                          warmup_steps_excluded=1, train_size=16, dev_size=4, evaluate=False,
                                          per_device_batch_size=4, echo=False).verified or 1 / 0)
print(json.dumps({"steps": steps, "driver_calls": calls}))
"""


def test_the_notebook_order_gpu_first_then_imports(tmp_path):
    """The other tests here import the training stack before the machine looks like a GPU box, so a
    CUDA call made while importing would go unseen. In a notebook the CUDA build is there first: a fresh
    interpreter becomes the GPU box right after `import torch`, then imports stnb and the training stack,
    sets up, plans and runs. Nothing may reach the driver, and every step must work."""
    _fake_smi(str(tmp_path), [H100])
    env = {**os.environ, "PYTHONPATH": ROOT, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    for var in ("CUDA_VISIBLE_DEVICES", "STNB_FORCE_CPU", "PYTORCH_NVML_BASED_CUDA_CHECK"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", NOTEBOOK_ORDER], capture_output=True, text=True, timeout=300,
                          env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["driver_calls"] == []
    assert {k: v for k, v in out["steps"].items() if v != "ok"} == {}

