"""Wrong TrainConfigs: each is rejected by stnb.run before any process starts, with a message
that names the cause and the fix (asserted on its key words).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

import faultcases as fc
import stnb
from stnb import ConfigError, StnbError, StrategyUnavailable, TrainConfig
from stnb.hardware import cpu_cores

CORES = cpu_cores()


def _files(tmp):
    """Bad data files / folders the cases point at."""
    (tmp / "empty.csv").write_text("")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "header_only.csv").write_text("sentence1,sentence2,score\n")
    (tmp / "wrong_columns.csv").write_text("question,answer\nwhat,that\n")
    (tmp / "pairs.txt").write_text("a\tb\n")
    (tmp / "triplets.jsonl").write_text('{"anchor": "q", "positive": "p", "negative": "n"}\n')
    (tmp / "scored.csv").write_text("sentence1,sentence2,score\na,b,0.5\n")
    (tmp / "unscored.csv").write_text("sentence1,sentence2\na,b\n")
    (tmp / "extra.csv").write_text("anchor,positive,source\nq,p,web\n")
    (tmp / "a_folder").mkdir()
    saved = tmp / "saved_model"
    saved.mkdir()
    (saved / "config.json").write_text("{}")
    return tmp


# (id, TrainConfig overrides ('{tmp}' is replaced by a temp folder), exception, words the message must contain)
CASES = [
    # unknown names
    ("unknown-strategy", dict(strategy="zero9"), ConfigError, ["unknown strategy 'zero9'", "choose one of", "'ddp'"]),
    ("unknown-loss", dict(loss="triplet"), ConfigError, ["unknown loss 'triplet'", "'cosine'", "'mnrl'"]),
    ("unknown-precision", dict(mixed_precision="fp8"), ConfigError, ["unknown mixed_precision", "'bf16'"]),
    ("unknown-comm-hook", dict(comm_hook="powersgd"), ConfigError, ["unknown comm_hook", "'fp16'"]),
    ("unknown-device", dict(device="tpu"), ConfigError, ["unknown device 'tpu'", "'cpu'"]),
    # types
    ("batch-size-str", dict(per_device_batch_size="16"), ConfigError,
     ["per_device_batch_size must be an integer", "'16'", "str"]),
    ("steps-float", dict(steps=5.5), ConfigError, ["steps must be an integer", "5.5"]),
    ("nproc-bool", dict(num_processes=True), ConfigError, ["num_processes must be an integer", "True"]),
    ("lr-str", dict(learning_rate="fast"), ConfigError, ["learning_rate must be a number", "'fast'"]),
    ("model-empty", dict(model=""), ConfigError, ["model must be", "'tiny'", "local path"]),
    # ranges
    ("batch-size-0", dict(per_device_batch_size=0), ConfigError, ["per_device_batch_size must be >= 1", "got 0"]),
    ("steps-0", dict(steps=0), ConfigError, ["steps must be >= 1", "got 0"]),
    ("steps-within-warmup", dict(steps=2, warmup_steps_excluded=2), ConfigError,
     ["leaves no measured step", "use steps >= 3", "warmup_steps_excluded"]),
    ("nproc-0", dict(num_processes=0), ConfigError, ["num_processes must be >= 1", "got 0"]),
    ("nproc-beyond-hardware", dict(num_processes=CORES + 1, device="cpu"), ConfigError,
     [f"num_processes={CORES + 1}", "CPU cores", f"num_processes <= {CORES}"]),
    ("negative-lr", dict(learning_rate=-2e-5), ConfigError, ["learning_rate must be a number > 0, got -2e-05"]),
    ("zero-timeout", dict(timeout=0), ConfigError, ["timeout must be a number > 0, got 0"]),
    ("negative-stall-timeout", dict(stall_timeout=-1.0), ConfigError, ["stall_timeout must be a number > 0, got -1.0"]),
    ("short-seq-len", dict(max_seq_length=4), ConfigError, ["max_seq_length must be >= 8"]),
    ("grad-accum-0", dict(gradient_accumulation_steps=0), ConfigError, ["gradient_accumulation_steps must be >= 1"]),
    ("threads-0", dict(threads_per_rank=0), ConfigError, ["threads_per_rank must be >= 1"]),
    ("negative-seed", dict(seed=-1), ConfigError, ["seed must be >= 0"]),
    # impossible combinations
    ("fsdp-one-process", dict(strategy="fsdp", num_processes=1), ConfigError,
     ["fsdp", "num_processes=1", "num_processes >= 2", "strategy='single'"]),
    ("ddp-one-gpu-process", dict(strategy="ddp", num_processes=1, device="cuda"), ConfigError,
     ["'ddp' with one process on a GPU", "DistributedDataParallel", "strategy='single'", "num_processes >= 2"]),
    ("zero1-one-gpu-process", dict(strategy="zero1", num_processes=1, device="cuda"), ConfigError,
     ["'zero1' with one process on a GPU", "DistributedDataParallel", "strategy='single'", "num_processes >= 2"]),
    ("single-two-processes", dict(strategy="single", num_processes=2), ConfigError,
     ["runs in one process", "one process per device (ddp, zero1, zero2, fsdp", "drop num_processes"]),
    ("gather-on-single", dict(strategy="single", loss="mnrl", gather_across_devices=True), ConfigError,
     ["nothing to gather", "strategy='ddp' or set gather_across_devices=False"]),
    ("cosine-with-gather", dict(loss="cosine", gather_across_devices=True), ConfigError,
     ["gather_across_devices only applies to loss='mnrl'", "set loss='mnrl' or gather_across_devices=False"]),
    ("mnrl-batch-1-single", dict(strategy="single", loss="mnrl", per_device_batch_size=1), ConfigError,
     ["needs at least 2 samples", "per_device_batch_size >= 2"]),
    ("ddp-knob-on-single", dict(strategy="single", comm_hook="fp16"), ConfigError,
     ["comm_hook='fp16' is an option of ddp / zero1", "not of strategy 'single'", "leave it at the default"]),
    ("ddp-knob-on-fsdp", dict(strategy="fsdp", static_graph=True), ConfigError,
     ["static_graph=True is an option of ddp / zero1", "not of strategy 'fsdp'"]),
    ("fsdp-knob-on-zero2", dict(strategy="zero2", reshard_after_forward=False), ConfigError,
     ["reshard_after_forward=False is an option of fsdp", "not of strategy 'zero2'"]),
    ("zero1-embedding-rows", dict(strategy="zero1", comm_hook="embedding_rows"), ConfigError,
     ["ZeroRedundancyOptimizer", "strategy='ddp'"]),
    ("zero3-name", dict(strategy="zero3"), ConfigError, ["unknown strategy 'zero3'", "strategy 'fsdp': ZeRO stage 3"]),
    ("evaluate-without-dev", dict(dev_size=0, evaluate=True), ConfigError,
     ["needs dev pairs", "dev_size > 0 or evaluate=False"]),
    ("fp16-on-cpu", dict(mixed_precision="fp16", device="cpu"), ConfigError, ["fp16", "needs a GPU", "'bf16'"]),
    # hardware this machine lacks
    ("dp-without-gpus", dict(strategy="dp"), StrategyUnavailable,
     ["strategy 'dp' cannot run here", "DataParallel needs at least 2 CUDA GPUs"]),
    ("cuda-without-gpu", dict(device="cuda"), ConfigError, ["no CUDA GPU", "device='cpu'"]),
    # resources
    ("missing-model", dict(model="/nonexistent/model"), ConfigError,
     ["/nonexistent/model", "does not exist", "'tiny'", "existing folder"]),
    ("model-is-a-file", dict(model="{tmp}/empty.csv"), ConfigError, ["is a file, not a model folder"]),
    ("model-folder-without-model", dict(model="{tmp}/a_folder"), ConfigError, ["holds no model"]),
    ("empty-csv", dict(data="{tmp}/empty.csv"), ConfigError, ["empty.csv", "is empty", "data='synthetic'"]),
    ("empty-jsonl", dict(data="{tmp}/empty.jsonl"), ConfigError, ["empty.jsonl", "is empty", "data='synthetic'"]),
    ("header-only-csv", dict(data="{tmp}/header_only.csv"), ConfigError, ["has no rows", "add rows"]),
    ("missing-data-file", dict(data="{tmp}/nope.csv"), ConfigError, ["nope.csv", "does not exist"]),
    ("wrong-columns", dict(data="{tmp}/wrong_columns.csv"), ConfigError,
     ["['question', 'answer']", "(sentence1, sentence2, score)", "columns={'question': 'sentence1'}"]),
    # data columns vs the loss: every column is used, or the run is refused
    ("triplets-with-cosine", dict(data="{tmp}/triplets.jsonl", loss="cosine"), ConfigError,
     ["['anchor', 'positive', 'negative']", "['negative'] would not be used", "loss='mnrl'",
      "columns={'negative': None}"]),
    ("mnrl-with-scores", dict(data="{tmp}/scored.csv", loss="mnrl"), ConfigError,
     ["takes no label", "'score' column would be ignored", "loss='cosine'", "columns={'score': None}"]),
    ("cosine-without-scores", dict(data="{tmp}/unscored.csv", loss="cosine"), ConfigError,
     ["no label column", "columns={'similarity': 'score'}", "loss='mnrl'"]),
    ("extra-column", dict(data="{tmp}/extra.csv", loss="mnrl"), ConfigError,
     ["['source'] are not inputs", "columns={'source': 'anchor'}", "columns={'source': None}"]),
    ("mapping-a-missing-column", dict(data="{tmp}/scored.csv", columns={"question": "sentence1"}), ConfigError,
     ["maps ['question']", "which the data does not have", "['sentence1', 'sentence2', 'score']"]),
    ("mapping-on-synthetic", dict(columns={"sentence1": "anchor"}), ConfigError,
     ["data='synthetic' has fixed columns"]),
    ("columns-not-a-dict", dict(columns=["anchor", "positive"]), ConfigError,
     ["columns must be a dict", "columns={'question': 'anchor'"]),
    # the hub, offline here: refused with the bundled alternatives
    ("hub-model-offline", dict(model="sentence-transformers/all-mpnet-base-v2"), ConfigError,
     ["'sentence-transformers/all-mpnet-base-v2'", "HF_HUB_OFFLINE=1", "model='minilm'", "'tiny'"]),
    ("hub-data-offline", dict(data="sentence-transformers/stsb"), ConfigError,
     ["'sentence-transformers/stsb'", "HF_HUB_OFFLINE=1", "data='synthetic'"]),
    # the seed's recipe (loss='softmax+cosine'): two datasets, each with the columns its loss reads
    ("softmax-cosine-one-file", dict(loss="softmax+cosine", data="{tmp}/scored.csv"), ConfigError,
     ["trains two datasets", "SoftmaxLoss", "CosineSimilarityLoss", "data='nli.csv+sts.csv'", "data='synthetic'"]),
    ("softmax-cosine-nli-without-label", dict(loss="softmax+cosine", data="{tmp}/unscored.csv+{tmp}/scored.csv"),
     ConfigError, ["'nli' dataset (SoftmaxLoss)", "['sentence1', 'sentence2']", "(sentence1, sentence2, label)",
                   "no label column"]),
    ("softmax-cosine-sts-without-score", dict(loss="softmax+cosine", data="{tmp}/scored.csv+{tmp}/unscored.csv"),
     ConfigError, ["'sts' dataset (CosineSimilarityLoss)", "['sentence1', 'sentence2']",
                   "(sentence1, sentence2, score)"]),
    ("softmax-cosine-with-gather", dict(loss="softmax+cosine", gather_across_devices=True), ConfigError,
     ["gather_across_devices only applies to loss='mnrl'", "not loss='softmax+cosine'"]),
    ("softmax-cosine-with-columns", dict(loss="softmax+cosine", columns={"question": "sentence1"}), ConfigError,
     ["two datasets with fixed columns", "give your files those column names"]),
    ("softmax-cosine-hub-offline", dict(loss="softmax+cosine", data="hub"), ConfigError,
     ["'sentence-transformers/all-nli:pair-class'", "HF_HUB_OFFLINE=1", "data='synthetic'"]),
    ("data-is-a-folder", dict(data="{tmp}/a_folder"), ConfigError, ["is a folder", ".csv/.jsonl/.parquet"]),
    ("data-unsupported-type", dict(data="{tmp}/pairs.txt"), ConfigError, ["unsupported type", ".json or .parquet"]),
    ("save-to-non-empty-dir", dict(save_to="{tmp}/saved_model"), ConfigError,
     ["saved_model", "already exists and is not empty", "new folder"]),
]
if torch.cuda.is_available():  # these cases describe a machine without GPUs
    CASES = [c for c in CASES if c[0] not in ("dp-without-gpus", "cuda-without-gpu", "fp16-on-cpu")]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    return _files(tmp_path_factory.mktemp("bad_input"))


def _expand(overrides, tmp):
    return {k: (v.format(tmp=tmp) if isinstance(v, str) and "{tmp}" in v else v) for k, v in overrides.items()}


@pytest.mark.parametrize("name, overrides, exc, words", CASES, ids=[c[0] for c in CASES])
def test_rejected_before_any_process(name, overrides, exc, words, bad_files):
    cfg = TrainConfig(model="minilm", device="cpu", steps=3).replace(**_expand(overrides, bad_files))
    before = fc.descendants()
    with fc.ChildSampler(before) as sampler:
        with pytest.raises(exc) as ei:
            stnb.run(cfg, echo=False)
    assert isinstance(ei.value, StnbError)
    msg = str(ei.value)
    for w in words:
        assert w.replace("{tmp}", str(bad_files)) in msg, f"{name}: {w!r} not in message:\n{msg}"
    assert not sampler.seen, f"{name}: a process was started before the refusal"
    assert fc.new_descendants(before) == []


def test_overrides_are_checked_too():
    # stnb.run(cfg, steps=0): keyword overrides go through the same validation
    with pytest.raises(ConfigError, match="steps must be >= 1"):
        stnb.run(TrainConfig(device="cpu"), echo=False, steps=0)


@pytest.mark.parametrize("names, hint", [({"stepz": 5}, "'stepz' -> 'steps'"),
                                         ({"lr": 1e-3}, None),
                                         ({"batch_size": 8}, None)])
def test_unknown_field_names(names, hint):
    before = fc.descendants()
    with pytest.raises(ConfigError) as ei:
        stnb.run(TrainConfig(device="cpu"), echo=False, **names)
    msg = str(ei.value)
    assert "unknown TrainConfig field" in msg and repr(next(iter(names))) in msg and "valid fields" in msg
    assert "learning_rate" in msg and "per_device_batch_size" in msg  # the valid names are listed
    if hint:
        assert hint in msg
    with pytest.raises(ConfigError, match="unknown TrainConfig field"):
        TrainConfig.from_dict(names)
    assert fc.new_descendants(before) == []


def test_every_case_is_distinct_and_enough():
    assert len(CASES) >= 15
    assert len({c[0] for c in CASES}) == len(CASES)
