"""stnb.run end to end with real processes on CPU (gloo), using the tiny random BERT."""

import json
import os
import subprocess
import sys

import psutil
import pytest

import stnb
from stnb import strategies

SMALL = dict(model="tiny", steps=4, train_size=128, dev_size=32, warmup_steps_excluded=1)
REQUIRED_KEYS = {"strategy", "world_size", "per_device_batch_size", "global_batch_size", "steps",
                 "samples_per_second", "step_times", "losses", "peak_memory_bytes", "local_param_count",
                 "total_param_count", "verified", "verification", "model", "device", "versions"}


def _children():
    return psutil.Process().children(recursive=True)


@pytest.fixture(scope="module")
def ddp_and_single():
    ddp = stnb.run(stnb.TrainConfig(strategy="ddp", num_processes=2, per_device_batch_size=4, **SMALL))
    single = stnb.run(stnb.TrainConfig(strategy="single", per_device_batch_size=8, **SMALL))
    return ddp, single


def test_ddp_two_ranks_verified(ddp_and_single):
    r, _ = ddp_and_single
    assert r.strategy == "ddp" and r.world_size == 2 and r.verified
    assert r.global_batch_size == 8 and r.per_device_batch_size == 4
    ranks = r.verification["ranks"]
    assert [v["world_size_seen"] for v in ranks] == [2, 2]
    assert all(v["wrapper"] == "DistributedDataParallel" and v["backend"] == "gloo" for v in ranks)
    assert r.verification["weights_identical_across_ranks"] is True
    assert len(r.losses) == 4 and len(r.step_times) == 4
    assert r.samples_per_second > 0
    assert r.local_param_count == [r.total_param_count] * 2
    assert len(r.peak_memory_bytes) == 2 and all(m > 0 for m in r.peak_memory_bytes)
    assert r.spearman_before is not None and -1 <= r.spearman_after <= 1
    assert not _children(), "a rank process survived the run"


def test_result_forms(ddp_and_single):
    r, _ = ddp_and_single
    d = r.to_dict()
    assert REQUIRED_KEYS <= set(d)
    assert json.loads(json.dumps(d)) == d  # JSON-serialisable as is
    df = r.to_frame()
    assert len(df) == 1 and df.loc[0, "strategy"] == "ddp"
    assert stnb.RunResult.from_dict(d).to_dict() == d


def test_ddp_matches_single_process_with_same_global_batch(ddp_and_single):
    """Same global batch (2 x 4 vs 1 x 8) and seed: DDP averages gradients exactly like one big batch."""
    ddp, single = ddp_and_single
    assert single.world_size == 1 and single.global_batch_size == ddp.global_batch_size == 8
    assert single.verification["ranks"][0]["wrapper"] == "SentenceTransformer"
    for a, b in zip(ddp.losses, single.losses):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-5)


def test_fsdp_shards_and_saves_a_loadable_model(tmp_path):
    target = tmp_path / "fsdp-model"
    r = stnb.run(stnb.TrainConfig(strategy="fsdp", num_processes=2, per_device_batch_size=4,
                                  save_to=str(target), **SMALL))
    assert r.verified and r.world_size == 2
    for v in r.verification["ranks"]:
        assert v["wrapper"].startswith("FSDP")
        assert v["local_param_fraction"] == pytest.approx(0.5, abs=0.05)
        assert v["wrapped_layer_class"] == ["BertLayer"]
    assert all(abs(n / r.total_param_count - 0.5) < 0.05 for n in r.local_param_count)
    # fsdp per-rank state is about half of DDP's
    mb = r.memory_breakdown[0]
    assert mb["params"] * 2 == pytest.approx(r.total_param_count * 4, rel=0.02)
    # the saved model is an ordinary SentenceTransformer
    from sentence_transformers import SentenceTransformer

    m = SentenceTransformer(str(target), device="cpu")
    emb = m.encode(["a saved model encodes"])
    assert emb.shape == (1, 64)
    saved = r.verification["saved_model"]  # the reloaded weights are the trained ones, not the initial ones
    assert saved["ok"] and saved["equals_trained"] and saved["differs_from_initial"] and saved["encodes_the_same"]
    assert r.verification["shards_add_up"] is True
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".stnb-save-")]


def test_fsdp_verification_fails_loudly_on_an_unsharded_model():
    from stnb.models import load_model, tiny_path

    model = load_model(tiny_path())
    with pytest.raises(stnb.VerificationError, match="not sharded|not an FSDP2 module"):
        strategies.verify("fsdp", model, model, world_size_expected=2)


def test_mnrl_with_gather_across_devices():
    r = stnb.run(stnb.TrainConfig(strategy="ddp", num_processes=2, per_device_batch_size=4, loss="mnrl",
                                  gather_across_devices=True, evaluate=False, **SMALL))
    assert r.verified and len(r.losses) == 4
    assert r.config["gather_across_devices"] is True


def test_results_file_appended(tmp_path):
    path = tmp_path / "runs.jsonl"
    stnb.run(stnb.TrainConfig(strategy="single", per_device_batch_size=4, evaluate=False, **SMALL),
             results_file=path)
    rows = stnb.load_results(path)
    assert len(rows) == 1 and rows.loc[0, "strategy"] == "single"


def test_cli_run_json_last_line():
    out = subprocess.run([sys.executable, "-m", "stnb", "run", "--strategy", "ddp", "--nproc", "2", "--model",
                          "tiny", "--steps", "3", "--batch-size", "4", "--no-eval", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert d["strategy"] == "ddp" and d["world_size"] == 2 and d["verified"] is True
    assert REQUIRED_KEYS <= set(d)


def test_cli_hardware():
    out = subprocess.run([sys.executable, "-m", "stnb", "hardware", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert set(d["strategies"]) == {"single", "dp", "ddp", "fsdp"}
    assert d["strategies"]["single"]["runnable"] is True
    if not d["gpus"]:
        assert d["strategies"]["dp"]["runnable"] is False and "GPU" in d["strategies"]["dp"]["reason"]


def test_cli_bad_input_exits_with_clear_error():
    out = subprocess.run([sys.executable, "-m", "stnb", "run", "--strategy", "zero3", "--model", "tiny"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown strategy 'zero3'" in out.stderr and "'ddp'" in out.stderr
