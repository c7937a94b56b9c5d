"""The seed's benchmark recipe as stnb's own loss 'softmax+cosine': NLI pairs with SoftmaxLoss and STS pairs
with CosineSimilarityLoss in one multi-dataset run (stnb.seed_recipe), its offline stand-ins, its hub
variant refused offline, and real 2-rank runs (gloo, tiny model, a few steps) under ddp, zero1 and fsdp,
and from the command line. Bad input (a file lacking columns, gather_across_devices) is in test_bad_input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import stnb
from stnb import ConfigError, TrainConfig, seed_recipe
from stnb.data import synthetic_pairs

RUN = dict(loss="softmax+cosine", model="tiny", device="cpu", num_processes=2, threads_per_rank=1, steps=4,
           train_size=64, dev_size=16, per_device_batch_size=4, learning_rate=1e-3, timeout=300)
CLASSIFIER = ["loss[nli].classifier.weight", "loss[nli].classifier.bias"]


def test_synthetic_stand_ins_have_the_seeds_shapes():
    train, dev = seed_recipe.load("synthetic", train_size=301, dev_size=40, seed=3)
    assert list(train) == ["nli", "sts"]
    assert train["nli"].column_names == ["sentence1", "sentence2", "label"]
    assert train["sts"].column_names == ["sentence1", "sentence2", "score"]
    assert (len(train["nli"]), len(train["sts"])) == (151, 150)  # train_size split evenly, NLI the odd row
    assert dev.column_names == ["sentence1", "sentence2", "score"] and len(dev) == 40
    # the STS rows are stnb.data's scored pairs; dev the rows after train
    reference = synthetic_pairs(190, 3)
    assert list(train["sts"]["sentence1"]) == list(reference["sentence1"])[:150]
    assert list(dev["sentence1"]) == list(reference["sentence1"])[150:190]
    # NLI rows are a stream of their own, every class present
    assert list(train["nli"]["sentence1"])[:20] != list(train["sts"]["sentence1"])[:20]
    assert set(train["nli"]["label"]) == {0, 1, 2}
    again, _ = seed_recipe.load("synthetic", train_size=301, dev_size=40, seed=3)
    assert list(again["nli"]["sentence2"]) == list(train["nli"]["sentence2"])
    other, _ = seed_recipe.load("synthetic", train_size=301, dev_size=40, seed=4)
    assert list(other["nli"]["sentence2"]) != list(train["nli"]["sentence2"])


def test_nli_labels_are_bands_of_the_generators_own_similarity():
    """Entailment: similarity >= 0.7, contradiction: < 0.3, neutral between (the documented bands)."""
    train, _ = seed_recipe.load("synthetic", train_size=600, dev_size=1, seed=0)
    scores = list(synthetic_pairs(300, "nli:0")["score"])  # the stream the NLI rows come from
    assert list(train["nli"]["sentence1"]) == list(synthetic_pairs(300, "nli:0")["sentence1"])
    for label, score in zip(list(train["nli"]["label"]), scores):
        assert (label == 0) == (score >= 0.7) and (label == 2) == (score < 0.3), (label, score)
    counts = [list(train["nli"]["label"]).count(c) for c in (0, 1, 2)]
    assert min(counts) > len(scores) / 5, counts  # roughly a third each


def test_two_files_load_as_the_two_datasets(tmp_path):
    nli, sts = tmp_path / "nli.jsonl", tmp_path / "sts.csv"
    nli.write_text("".join(json.dumps({"sentence1": f"a{i}", "sentence2": f"b{i}", "label": i % 3}) + "\n"
                           for i in range(12)))
    sts.write_text("sentence1,sentence2,score\n" + "".join(f"c{i},d{i},{i % 6}\n" for i in range(20)))
    spec = f"{nli}+{sts}"
    TrainConfig(loss="softmax+cosine", model="tiny", data=spec, device="cpu").validate()
    train, dev = seed_recipe.load(spec, train_size=10, dev_size=5, seed=0)
    assert list(train["nli"]["label"]) == [i % 3 for i in range(5)]  # class labels stay integers
    assert list(train["sts"]["sentence1"]) == [f"c{i}" for i in range(5)]
    assert list(dev["sentence1"]) == [f"c{i}" for i in range(5, 10)]
    assert max(list(train["sts"]["score"]) + list(dev["score"])) == 1.0  # the 0-5 STS scale divided by 5


def test_hub_variant_is_refused_offline_with_the_fix():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest: no hub here
    with pytest.raises(ConfigError) as ei:
        seed_recipe.check("hub")
    msg = str(ei.value)
    assert "'sentence-transformers/all-nli:pair-class'" in msg and "HF_HUB_OFFLINE=1" in msg
    assert "data='synthetic'" in msg
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE=1"):  # the loader refuses the same way
        seed_recipe.load("hub", train_size=10, dev_size=2, seed=0)


def _check_synced_classifier(r):
    assert r.verified, r.reason
    v = r.verification
    assert v["ranks"][0]["trained_parameters"]["loss"] == CLASSIFIER
    assert v["ranks"][0]["trained_parameters"]["loss_parameters_synced"] is True
    assert v["weights_identical_across_ranks"] is True
    per = v["loss_inputs_per_dataset"]
    assert per["nli"]["columns"] == ["sentence1", "sentence2", "label"]
    assert per["sts"]["columns"] == ["sentence1", "sentence2", "score"]
    assert all(per[name]["ok"] is True for name in ("nli", "sts")), per  # both losses ran in 4 steps
    assert r.dev_metric == "dev_spearman_cosine" and r.spearman_after is not None


def test_ddp_trains_one_classifier_across_ranks():
    r = stnb.run(TrainConfig(strategy="ddp", **RUN), echo=False)
    _check_synced_classifier(r)
    assert r.config["loss"] == "softmax+cosine"


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_sharding_strategies_train_it_verified(strategy):
    r = stnb.run(TrainConfig(strategy=strategy, **RUN), echo=False)
    _check_synced_classifier(r)
    assert r.verification["weights_tensors_compared"] >= len(CLASSIFIER)


def test_single_process_trains_it():
    r = stnb.run(TrainConfig(strategy="single", **{k: v for k, v in RUN.items() if k != "num_processes"}), echo=False)
    assert r.verified, r.reason
    trained = r.verification["ranks"][0]["trained_parameters"]
    assert trained["loss"] == CLASSIFIER and trained["loss_parameters_synced"] is False  # one process: nothing to sync
    assert set(r.verification["loss_inputs_per_dataset"]) == {"nli", "sts"}
    assert r.losses and r.dev_metric == "dev_spearman_cosine"


def test_command_line_ddp_run_is_verified():
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "stnb", "run", "--loss", "softmax+cosine", "--strategy", "ddp",
                          "--nproc", "2", "--model", "tiny", "--steps", "3", "--train-size", "48", "--dev-size", "8",
                          "--device", "cpu", "--threads-per-rank", "1", "--json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["verified"], result["reason"]
    assert result["config"]["loss"] == "softmax+cosine"
    assert result["verification"]["ranks"][0]["trained_parameters"]["loss"] == CLASSIFIER


def _checked(loss_inputs):
    from stnb.results import cross_rank_checks

    from stnb.rankreport import RankReport

    rank = RankReport(rank=0, device="cpu", global_batch_size=8, step_times=[1.0], losses=[0.5],
                      verification={"ok": True}, peak_memory_bytes=1, weight_digests={}, loss_inputs=loss_inputs,
                      data_columns={"nli": ["sentence1", "sentence2", "label"], "sentence": ["sentence1", "score"]})
    return cross_rank_checks(TrainConfig(strategy="single", device="cpu"), [rank])


def test_a_dict_of_datasets_is_checked_per_dataset():
    """Each dataset's columns against what its own loss received; one whose loss never ran is reported as such."""
    v, problems = _checked({"nli": {"texts": 2, "label": True}, "sentence": {"texts": 1, "label": True}})
    assert problems == [] and v["loss_received_all_columns"] is True
    v, problems = _checked({"nli": {"texts": 1, "label": True}})
    assert v["loss_inputs_per_dataset"]["nli"]["ok"] is False and v["loss_received_all_columns"] is False
    assert len(problems) == 1 and "dataset 'nli'" in problems[0] and "{'texts': 1, 'label': True}" in problems[0]
    assert v["loss_inputs_per_dataset"]["sentence"]["ok"] is None
    assert "did not run" in v["loss_inputs_per_dataset"]["sentence"]["note"]
