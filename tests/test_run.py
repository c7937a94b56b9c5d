"""stnb.run end to end with real processes on CPU (gloo), using the tiny random BERT."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import procs

import stnb
from stnb import strategies

SMALL = dict(model="tiny", steps=4, train_size=128, dev_size=32, warmup_steps_excluded=1)
# Enough steps at a learning rate high enough that training moves the weights far more than the
# tolerance DDP and one big batch are compared with (measured: moved 4.8e-2, apart 1.3e-5).
EQUIV = dict(model="tiny", steps=10, learning_rate=5e-3, train_size=256, dev_size=32, warmup_steps_excluded=1)
EQUIV_TOL = 2e-4
REQUIRED_KEYS = {"strategy", "world_size", "per_device_batch_size", "global_batch_size", "steps",
                 "samples_per_second", "step_times", "losses", "peak_memory_bytes", "local_param_count",
                 "total_param_count", "verified", "verification", "model", "device", "versions"}


def saved_weights(path) -> dict:
    """The tensors of a saved SentenceTransformer, by name (read from its safetensors files)."""
    from safetensors.torch import load_file

    files = sorted(pathlib.Path(path).rglob("*.safetensors"))
    assert files, f"no weights saved under {path}"
    out = {}
    for f in files:
        out.update({f"{f.parent.relative_to(path)}/{k}": v for k, v in load_file(f).items()})
    return out


def max_abs_diff(a: dict, b: dict) -> dict:
    """{tensor name: max |a - b|}; both must hold exactly the same tensors."""
    assert set(a) == set(b), set(a) ^ set(b)
    return {k: (a[k].double() - b[k].double()).abs().max().item() for k in a}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """2 ranks x 4 pairs, dropout 0 (the tiny model), final weights saved by rank 0."""
    target = tmp_path_factory.mktemp("ddp") / "model"
    return stnb.run(stnb.TrainConfig(strategy="ddp", num_processes=2, per_device_batch_size=4,
                                     save_to=str(target), **EQUIV))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process with the same global batch (8), seed and data order."""
    target = tmp_path_factory.mktemp("single") / "model"
    return stnb.run(stnb.TrainConfig(strategy="single", per_device_batch_size=8, evaluate=False,
                                     save_to=str(target), **EQUIV))


def test_ddp_two_ranks_verified(ddp):
    r = ddp
    assert r.strategy == "ddp" and r.world_size == 2 and r.verified
    assert r.global_batch_size == 8 and r.per_device_batch_size == 4
    ranks = r.verification["ranks"]
    assert [v["world_size_seen"] for v in ranks] == [2, 2]
    assert all(v["wrapper"] == "DistributedDataParallel" and v["backend"] == "gloo" for v in ranks)
    assert r.verification["weights_identical_across_ranks"] is True
    assert len(r.losses) == EQUIV["steps"] and len(r.step_times) == EQUIV["steps"]
    assert r.samples_per_second > 0
    assert r.local_param_count == [r.total_param_count] * 2
    assert len(r.peak_memory_bytes) == 2 and all(m > 0 for m in r.peak_memory_bytes)
    assert not procs.children(), "a rank process survived the run"


def test_ddp_buffer_sync_setting_reaches_ddp_without_a_deprecation_warning():
    """sentence-transformers turns DDP's buffer broadcast off; torch 2.13 deprecates the old name, so
    stnb passes forward_sync_buffers: the setting as DDP holds it, and no FutureWarning in any rank.
    (A process of its own: ranks forked from pytest would record their warnings, not print them.)"""
    import subprocess
    import sys

    code = ("import stnb; r = stnb.run(stnb.TrainConfig(model='tiny', strategy='ddp', num_processes=2, steps=3, "
            "warmup_steps_excluded=1, evaluate=False, device='cpu'), echo=True); "
            "print('RESULT', r.verified, [v['ddp_settings']['broadcast_buffers'] for v in r.verification['ranks']])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "RESULT True [False, False]" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "`broadcast_buffers` is deprecated" not in proc.stdout + proc.stderr


def test_spearman_scores_are_the_initial_and_the_trained_models(ddp):
    """spearman_before/after are the dev scores of the model before training and of the trained
    (saved) one: recomputed here from those two models, independently of the run."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    from stnb.data import load_pairs
    from stnb.models import resolve_model

    cfg = stnb.TrainConfig(**ddp.config)
    _, dev = load_pairs(cfg.data, cfg.train_size, cfg.dev_size, cfg.seed)
    ev = EmbeddingSimilarityEvaluator(dev["sentence1"], dev["sentence2"], dev["score"], name="dev",
                                      show_progress_bar=False)

    def score(path):
        model = SentenceTransformer(str(path), device="cpu")
        model.max_seq_length = cfg.max_seq_length
        return ev(model)[ev.primary_metric]

    before, after = score(resolve_model(cfg.model)), score(ddp.saved_to)
    assert before != pytest.approx(after, abs=1e-3), "training did not change the dev score"
    assert ddp.spearman_before == pytest.approx(before, abs=1e-6)
    assert ddp.spearman_after == pytest.approx(after, abs=1e-6)


def test_result_forms(ddp):
    r = ddp
    d = r.to_dict()
    assert REQUIRED_KEYS <= set(d)
    assert json.loads(json.dumps(d)) == d  # JSON-serialisable as is
    df = r.to_frame()
    assert len(df) == 1 and df.loc[0, "strategy"] == "ddp"
    assert stnb.RunResult.from_dict(d).to_dict() == d


def test_ddp_final_weights_equal_one_big_batch(ddp, single):
    """Same global batch (2 x 4 vs 1 x 8), seed and data order, no dropout: DDP's averaged gradients
    are one big batch's, so after 10 steps the final weights agree tensor by tensor, while training
    moved them far from where they started. A DDP that never all-reduced trains rank 0 on its own half."""
    from stnb.models import resolve_model

    assert single.world_size == 1 and single.global_batch_size == ddp.global_batch_size == 8
    assert single.verification["ranks"][0]["wrapper"] == "SentenceTransformer"
    start = saved_weights(resolve_model("tiny"))
    moved = max_abs_diff(saved_weights(single.saved_to), start)
    assert max(moved.values()) > 100 * EQUIV_TOL, f"training barely moved the weights: {max(moved.values()):.2e}"
    assert sum(m > EQUIV_TOL for m in moved.values()) > len(moved) // 2, "most tensors did not train"
    worst, gap = _apart(ddp, single)
    assert gap < EQUIV_TOL, f"DDP and one big batch differ by {gap:.2e} in {worst}"


def _apart(ddp, single) -> tuple:
    """The tensor where the two runs' saved weights differ most, and by how much."""
    apart = max_abs_diff(saved_weights(ddp.saved_to), saved_weights(single.saved_to))
    worst = max(apart, key=apart.get)
    return worst, apart[worst]


@pytest.mark.slow
def test_ranks_shuffling_the_data_each_their_own_way_are_caught(single, tmp_path, monkeypatch):
    """A fault injected at run time: each rank's trainer shuffles the data with its own seed (data_seed +
    rank), so the ranks no longer split one shuffle between them. Their weights still agree (stnb's
    cross-rank check cannot see it), but they are no longer one big batch's: the comparison above fails."""
    from sentence_transformers import SentenceTransformerTrainingArguments as Args

    real = Args.__post_init__

    def post_init(self):
        real(self)
        self.data_seed = (self.seed if self.data_seed is None else self.data_seed) + int(os.environ.get("RANK", "0"))

    monkeypatch.setattr(Args, "__post_init__", post_init)
    ddp = stnb.run(stnb.TrainConfig(strategy="ddp", num_processes=2, per_device_batch_size=4,
                                    save_to=str(tmp_path / "model"), **EQUIV))
    assert ddp.verified, ddp.reason
    worst, gap = _apart(ddp, single)
    assert gap > EQUIV_TOL, f"ranks drawing their own batches still trained like one big batch ({gap:.2e})"


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


def test_verify_compares_the_world_size_with_the_requested_one():
    """Outside a process group a rank sees world size 1: asked for 2, verification must say so."""
    from stnb.models import load_model, tiny_path

    model = load_model(tiny_path())
    with pytest.raises(stnb.VerificationError, match="world size 2 was requested, but the process group has 1 rank"):
        strategies.verify("ddp", model, model, world_size_expected=2)


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
    assert set(d["strategies"]) == set(stnb.strategies.names()) >= {"single", "dp", "ddp", "zero1", "zero2", "fsdp"}
    assert d["strategies"]["single"]["runnable"] is True
    if not d["gpus"]:
        assert d["strategies"]["dp"]["runnable"] is False and "GPU" in d["strategies"]["dp"]["reason"]


def test_cli_bad_input_exits_with_clear_error():
    out = subprocess.run([sys.executable, "-m", "stnb", "run", "--strategy", "zero3", "--model", "tiny"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown strategy 'zero3'" in out.stderr and "'ddp'" in out.stderr
