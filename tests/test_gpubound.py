"""gpu-check's GPU-bound rows and the ranks-sharing-a-GPU row (issue 47), on CPU: the plan, the long texts
that fill every sequence, the decision rules (interleaved pairs, MFU), and the rows' code on gloo ranks and
the tiny model. What they measured on an H200 is in docs/gpu.md."""

from __future__ import annotations

import json

import pytest

from stnblab import gpucheck
from stnblab.gpucheck import checks, gpubound, shared
from stnblab.gpucheck.planning import Check, Machine

H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2 ** 30, "compute_capability": [9, 0]}
T4 = {"index": 0, "name": "Tesla T4", "memory_bytes": 15 * 2 ** 30, "compute_capability": [7, 5]}
ARCH = ["sm_75", "sm_80", "sm_86", "sm_90"]
# the H200's GPU-bound ratio row of 2026-11-30 (docs/gpu.md): each run's median step time, 5 interleaved repeats
H200_LEVELS = {"plain": [0.29778, 0.30149, 0.29856, 0.32568, 0.29845],
               "stnb": [0.29522, 0.30685, 0.29811, 0.30592, 0.29187],
               "stnb_split_off": [0.29723, 0.30301, 0.25564, 0.29170, 0.29616]}


def _machine(gpu=H100):
    return Machine(gpus=[gpu], torch_cuda="12.8", arch_list=ARCH, notebook="nb")


def test_the_gpu_bound_rows_run_only_when_asked_and_last():
    assert not [c for c in gpucheck.plan(_machine()) if c.kind in ("mfu",) or c.name.startswith("GPU-bound")]
    ch = gpucheck.plan(_machine(), gpu_bound=True)
    ratio, mfu = ch[-2:]
    assert (ratio.kind, mfu.kind) == ("ratio", "mfu")
    p = ratio.params
    assert (p["model"], p["max_seq_length"], p["per_device_batch_size"], p["mixed_precision"]) == \
        ("mpnet-base-random", 256, 64, "bf16")
    assert p["repeats"] >= checks.PAIRED_MIN == 5 and p["goal"] == 0.98 and p["long_words"] > p["max_seq_length"] // 2
    assert mfu.params["mixed_precision"] == "bf16"
    t4 = gpucheck.plan(_machine(T4), gpu_bound=True)
    assert {c.params["mixed_precision"] for c in t4[-2:]} == {"fp16"}  # no bf16 before Ampere


def test_only_keeps_the_named_rows_and_the_hardware_row():
    ch = gpucheck.plan(_machine(), gpu_bound=True)
    kept = gpucheck.only(ch, ["gpu-bound", "2 RANKS"])
    assert [c.kind for c in kept] == ["hardware", "shared", "ratio", "mfu"]
    assert gpucheck.only(ch, []) == ch


def test_sharing_a_gpu_is_planned_with_stnbs_own_strategies_and_the_faults_that_need_a_peer():
    by = {c.name: c for c in gpucheck.plan(_machine())}
    probe = by["2 ranks on 1 GPU: nccl, gloo on CUDA tensors"]
    assert probe.kind == "shared" and probe.skip is None and not probe.params.get("stnb")
    own = by["stnb strategies x2 sharing 1 GPU"]
    assert own.kind == "shared" and own.skip is None and own.params["stnb"]
    for fault in ("raise", "kill"):  # one GPU: the faults that need a peer run on two ranks sharing it
        row, = [c for c in by.values() if c.kind == "fault" and c.params.get("share_gpus") and c.params["fault"] == fault]
        assert row.skip is None and row.params["nproc"] == 2 and "sharing 1 GPU" in row.name


def test_long_texts_fill_every_sequence():
    """Every text of the GPU-bound rows is longer than max_seq_length in tokens, so each sequence is cut to
    exactly it: no padding, the same tokens in every arm. With short texts (20 words) they are not."""
    from transformers import AutoTokenizer

    from stnb.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    p = gpubound.GPU_BOUND

    def lengths(folder, words):
        rows = [json.loads(line) for line in open(gpubound.long_pairs_file(str(folder), 40, words))]
        assert len(rows) == 40 and all(0 <= r["score"] <= 1 for r in rows)
        return [len(tok(r[k])["input_ids"]) for r in rows for k in ("sentence1", "sentence2")]

    import tempfile

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        assert min(lengths(a, p["long_words"])) > p["max_seq_length"]
        assert open(gpubound.long_pairs_file(a, 40, p["long_words"])).read() == \
            open(gpubound.long_pairs_file(b, 40, p["long_words"])).read()  # deterministic
        assert min(lengths(b, 20)) < p["max_seq_length"]
    assert gpubound.long_texts(["a b", "c d e", "f"], 4) == ["a b c d e"]  # the short remainder is dropped


def test_five_interleaved_pairs_decide_the_ratio():
    """The H200's run: identical runs differed by 18.5 % (one fast stnb-split-off run), so the old rule said
    inconclusive; its five interleaved pairs (stnb / plain 0.983-1.065) all meet 0.98: passed. One pair below
    the goal makes it inconclusive, all below failed; fewer than five pairs leave it to the noise rule."""
    pairs = checks.pair_ratios(H200_LEVELS)
    assert [round(x, 3) for x in pairs] == [1.009, 0.983, 1.002, 1.065, 1.023]
    noise = checks.ratio_noise(H200_LEVELS)
    assert noise == pytest.approx(0.185, abs=1e-3)
    assert checks.ratio_verdict(0.993, noise, 0.98)[0] == "inconclusive"  # without the pairs
    assert checks.ratio_verdict(0.993, noise, 0.98, pairs) == ("passed", "")
    low = pairs[:-1] + [0.97]
    status, error = checks.ratio_verdict(0.99, noise, 0.98, low)
    assert status == "inconclusive" and "0.970-1.065" in error
    status, error = checks.ratio_verdict(0.9, noise, 0.98, [0.9, 0.91, 0.92, 0.95, 0.97])
    assert status == "failed" and "all 5 interleaved pairs" in error
    assert checks.ratio_verdict(0.993, noise, 0.98, pairs[:2])[0] == "inconclusive"  # 2 pairs: the noise rule
    assert checks.pair_ratios(H200_LEVELS, "stnb_split_off")[2] == pytest.approx(0.29856 / 0.25564)


def test_the_mfu_row_passes_only_with_a_trained_loss_and_a_sane_mfu():
    good = {"variant": "a", "final_loss": 0.1, "mfu": 0.07}
    assert gpubound.mfu_verdict([good]) == ("passed", "")
    assert gpubound.mfu_verdict([])[0] == "failed"
    for bad in ({"error": "RuntimeError: boom"}, {"final_loss": float("nan")}, {"final_loss": None},
                {"mfu": None}, {"mfu": 1.2}, {"mfu": 0.0}):
        status, error = gpubound.mfu_verdict([good, dict(good, variant="b", **bad)])
        assert status == "failed" and error.startswith("b: "), bad


def test_the_sharing_row_needs_both_gloo_probes():
    ok = {"gloo_allreduce": {"ok": True}, "gloo_ddp": {"ok": True}, "nccl": {"ok": False, "summary": "refused"}}
    assert gpubound.shared_verdict(ok) == ("passed", "")  # NCCL's refusal is reported, not judged
    for probe in ("gloo_allreduce", "gloo_ddp"):
        status, error = gpubound.shared_verdict(dict(ok, **{probe: {"ok": False, "summary": "wrong result"}}))
        assert status == "failed" and "wrong result" in error
    assert gpubound.shared_verdict({})[0] == "failed"
    # with --stnb: stnb.parity of the strategies on two ranks sharing the GPU decides too
    assert gpubound.shared_verdict(dict(ok, stnb_parity={"ok": True, "summary": "parity passed"}))[0] == "passed"
    status, error = gpubound.shared_verdict(dict(ok, stnb_parity={"ok": False, "summary": "parity FAILED over gloo"}))
    assert status == "failed" and "share_gpus" in error and "parity FAILED over gloo" in error


def test_the_sharing_row_runs_its_gloo_probes_on_cpu():
    out = checks.RUNNERS["shared"](Check("shared [cpu]", "shared", {"device": "cpu", "timeout": 240}), Machine())
    assert out.status == "passed", out.error
    m = out.metrics
    assert set(m) == {"gloo_allreduce", "gloo_ddp"}  # NCCL is asked only on a GPU
    assert [r["value"] for r in m["gloo_allreduce"]["ranks"]] == [3.0, 3.0]
    assert all(r["max_grad_difference"] < 1e-5 for r in m["gloo_ddp"]["ranks"])


def test_the_sharing_rows_stnb_parity_runs_every_strategy_on_cpu():
    """The sharing row with --stnb: stnb.parity of stnb's recipe under every strategy runnable here against one
    device (on a GPU, two ranks sharing it; here gloo ranks on CPU cores), every one passed. deepspeed among them:
    parity ran the recipe with the config's own strategy's training arguments (ddp's use_cpu=True, which accelerate
    refuses under DeepSpeed: seen here failing with BuildError before parity._under)."""
    out = checks.RUNNERS["shared"](Check("shared [cpu]", "shared", {"device": "cpu", "stnb": True, "timeout": 600}),
                                   Machine())
    found = out.metrics["stnb_parity"]
    assert out.status == "passed" and found["ok"], out.error
    assert "parity passed over gloo" in found["summary"]
    rows = {r["strategy"]: r for r in found["table"] if r["role"] == "strategy"}
    from stnb import strategies

    expected = {n for n, a in stnb_availability().items() if a["runnable"] and strategies.get(n).distributed}
    assert set(rows) == expected and "deepspeed" in expected
    assert all(r["passed"] and r["verified"] for r in rows.values())


def stnb_availability() -> dict:
    from stnb.hardware import strategy_availability

    return strategy_availability("cpu")


def test_the_ddp_probe_catches_gradients_that_were_not_averaged(monkeypatch, tmp_path):
    """The DDP probe compares a rank's gradient with one device's on the whole batch: where nothing averages
    the ranks' gradients (DDP replaced by a plain wrapper, no process group) rank 0 keeps its half's
    gradient, and the probe reports the difference and fails."""
    import torch
    import torch.distributed as dist

    class NoSync(torch.nn.Module):
        def __init__(self, module, **kw):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", NoSync)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    shared._rank(0, "gloo_ddp", "cpu", "unused", str(tmp_path / "rank"))
    found = json.loads((tmp_path / "rank.0").read_text())
    assert "error" not in found, found
    assert found["ok"] is False and found["max_grad_difference"] > 1e-5


def test_the_gpu_bound_ratio_trains_every_arm_on_the_long_texts():
    """The GPU-bound ratio row on CPU with the tiny model: plain sentence-transformers, stnb and stnb with its
    time split off all train on the long texts (every sample 2 x max_seq_length padded tokens), each arm's
    MFU is reported (None here: no peak on a CPU), and the interleaved pairs are recorded."""
    p = dict(gpubound.GPU_BOUND, model="tiny", per_device_batch_size=4, max_seq_length=48, steps=4,
             warmup_steps_excluded=1, train_size=24, dev_size=8, device="cpu", mixed_precision="no",
             strategy="single", goal=0.0, repeats=1)
    out = checks.RUNNERS["ratio"](Check("gpu-bound [cpu]", "ratio", p), Machine())
    assert out.status == "passed", out.error
    m = out.metrics
    assert m["arm_tokens_per_sample"] == {arm: 2 * 48.0 for arm in checks.RATIO_ARMS}
    assert set(m["arm_mfu"]) == set(checks.RATIO_ARMS) and m["arm_mfu"]["plain"] is None
    assert len(m["pair_ratios"]) == 1 and m["pair_ratios"][0] > 0


def test_the_mfu_row_runs_each_variant_on_cpu():
    """The MFU row's plumbing: each variant is one plain run on the long texts with the attention kernel it
    asks for; on a CPU there is no peak, so the row fails (an MFU is never made up)."""
    p = dict(gpubound.GPU_BOUND, model="tiny", per_device_batch_size=4, max_seq_length=48,
             steps=gpubound.MFU_LOGGING_STEPS, warmup_steps_excluded=1, train_size=24, dev_size=8, device="cpu", mixed_precision="no",
             variants=(("tiny eager", "tiny", ["--attn", "eager"]), ("tiny sdpa", "tiny", ["--attn", "sdpa"]),
                       ("tiny, 2 workers", "tiny", ["--attn", "sdpa", "--workers", "2"])))
    out = checks.RUNNERS["mfu"](Check("mfu [cpu]", "mfu", p), Machine())
    rows = out.metrics["variants"]
    assert [(r["variant"], r["attn"], r["tokens_per_sample"]) for r in rows] == \
        [("tiny eager", "eager", 96.0), ("tiny sdpa", "sdpa", 96.0), ("tiny, 2 workers", "sdpa", 96.0)]
    # the tokenization lever: the collator runs in 2 dataloader processes (seen while training), none without
    assert [r["dataloader_workers_seen"] for r in rows] == [0, 0, 2]
    assert all(r["samples_per_second"] > 0 and r["final_loss"] is not None for r in rows)
    assert out.status == "failed" and "MFU None" in out.error
