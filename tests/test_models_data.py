"""stnb.models and stnb.data with real objects: the tiny and MiniLM models, synthetic and file data.

No network: the hub is switched to offline mode before anything Hugging Face is imported.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hashlib
import json
import shutil
import statistics
import threading

import pytest
import torch

from stnb import data, models
from stnb.config import TrainConfig
from stnb.errors import ConfigError

torch.set_num_threads(1)  # the machine is shared; these models are small


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def stnb_cache(tmp_path_factory):
    """A private STNB_CACHE for this module, holding one tiny build."""
    cache = tmp_path_factory.mktemp("stnb_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STNB_CACHE", str(cache))
        models.tiny_path()
        yield cache


@pytest.fixture
def tiny_env(stnb_cache, monkeypatch):
    monkeypatch.setenv("STNB_CACHE", str(stnb_cache))
    return stnb_cache


@pytest.fixture(scope="module")
def minilm():
    return models.load_model("minilm", device="cpu")


def _hashes(folder) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


# ---- models ------------------------------------------------------------------------------------

def test_tiny_builds_into_cache_and_loads_offline(tiny_env):
    from sentence_transformers import SentenceTransformer

    path = models.tiny_path()
    assert path == os.path.join(str(tiny_env), "tiny-bert-v1")
    assert models.resolve_model("tiny") == path
    # nothing half-written is left next to it
    assert sorted(os.listdir(tiny_env)) == ["tiny-bert-v1"]

    st = SentenceTransformer(path, device="cpu")
    emb = st.encode(["A man is eating an apple.", "A dog runs."], convert_to_tensor=True)
    assert emb.shape == (2, 64)
    assert torch.allclose(emb.norm(dim=1), torch.ones(2), atol=1e-5)  # Normalize, like MiniLM
    cfg = st[0].auto_model.config
    assert (cfg.hidden_dropout_prob, cfg.attention_probs_dropout_prob) == (0.0, 0.0)
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (2, 64)

    m = models.load_model("tiny", max_seq_length=32)
    assert m.max_seq_length == 32
    n = models.count_parameters(m)
    assert n == sum(p.numel() for p in m.parameters()) and 1_000_000 < n < 5_000_000


def test_tiny_rebuild_is_byte_identical_and_concurrent_safe(tiny_env):
    path = models.tiny_path()
    before = _hashes(path)
    assert "model.safetensors" in before and "modules.json" in before
    shutil.rmtree(path)

    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    results, errors = [], []

    def build():
        try:
            results.append(models.tiny_path())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == [path, path]
    assert _hashes(path) == before
    assert sorted(os.listdir(tiny_env)) == ["tiny-bert-v1"]  # temp folders cleaned up
    # building did not disturb the caller's random state
    assert torch.equal(torch.rand(3), expected_next)


def test_tiny_shares_minilm_tokenizer(tiny_env, minilm):
    tiny = models.load_model("tiny")
    text = ["Sentence transformers are neat."]
    assert tiny.preprocess(text)["input_ids"].tolist() == minilm.preprocess(text)["input_ids"].tolist()


def test_minilm_loads_and_encodes(minilm):
    path = models.minilm_path()
    assert isinstance(path, str) and os.path.isfile(os.path.join(path, "modules.json"))
    assert models.resolve_model("minilm") == path
    emb = minilm.encode(["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue."],
                        convert_to_tensor=True)
    assert emb.shape == (3, 384)
    sim = emb @ emb.T
    assert sim[0, 1] > sim[0, 2]
    assert 22_000_000 < models.count_parameters(minilm) < 23_000_000


def test_layer_classes(tiny_env, minilm):
    from transformers.models.bert.modeling_bert import BertLayer

    tiny = models.load_model("tiny")
    assert models.layer_classes(tiny) == [BertLayer]
    assert models.layer_classes(minilm) == [BertLayer]
    assert models.layer_classes(minilm, "BertLayer") == [BertLayer]

    with pytest.raises(ConfigError) as e:
        models.layer_classes(tiny, "LlamaDecoderLayer")
    msg = str(e.value)
    assert "LlamaDecoderLayer" in msg and "BertLayer" in msg and "candidates" in msg

    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    with pytest.raises(ConfigError, match="cannot tell which layers of this Sequential to wrap"):
        models.layer_classes(plain)
    # FSDP names its own option in the fix, before any process group is needed
    from stnb.strategies.fsdp import shard_fsdp

    with pytest.raises(ConfigError, match=r"name the block class; candidates: .*; e.g. TrainConfig\(fsdp_layer_cls="):
        shard_fsdp(plain, "cpu", 2)
    with pytest.raises(ConfigError, match="^fsdp_layer_cls 'LlamaDecoderLayer': no submodule of class LlamaDecoderLayer"):
        shard_fsdp(tiny, "cpu", 2, layer_cls="LlamaDecoderLayer")
    assert models.layer_classes(plain, "Linear") == [torch.nn.Linear]


def test_resolve_model_paths_and_hub_ids(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError) as e:
        models.resolve_model(str(missing))
    msg = str(e.value)
    assert str(missing) in msg and "does not exist" in msg
    assert "'minilm'" in msg and "'tiny'" in msg and "sentence-transformers/all-mpnet-base-v2" in msg

    with pytest.raises(ConfigError, match="no model"):
        models.resolve_model(str(tmp_path))  # exists, but holds no config.json / modules.json
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ConfigError, match="not a model folder"):
        models.resolve_model(str(tmp_path / "f.txt"))
    with pytest.raises(ConfigError, match="does not exist"):
        models.resolve_model("./surely/not/here")

    (tmp_path / "config.json").write_text("{}")
    assert models.resolve_model(str(tmp_path)) == str(tmp_path)
    # hub ids are checked (offline here, and not cached): refused with the bundled alternatives
    for hub_id in ("sentence-transformers/all-mpnet-base-v2", "bert-base-uncased"):
        with pytest.raises(ConfigError) as e:
            models.resolve_model(hub_id)
        msg = str(e.value)
        assert repr(hub_id) in msg and "HF_HUB_OFFLINE=1" in msg and "'minilm'" in msg and "'tiny'" in msg
    with pytest.raises(ConfigError):
        models.resolve_model("")


def test_load_model_hub_offline_is_config_error():
    with pytest.raises(ConfigError, match="hub"):
        models.load_model("sentence-transformers/all-mpnet-base-v2")


def test_trainconfig_validate_uses_resolve_and_check(tmp_path):
    base = TrainConfig(strategy="single", device="cpu", steps=3, warmup_steps_excluded=1)
    with pytest.raises(ConfigError, match="does not exist"):
        base.replace(model=str(tmp_path / "missing")).validate()
    with pytest.raises(ConfigError, match="does not exist"):
        base.replace(model="minilm", data=str(tmp_path / "missing.csv")).validate()
    base.replace(model="minilm", data="synthetic").validate()  # a valid config passes


# ---- synthetic data ----------------------------------------------------------------------------

def test_synthetic_deterministic_and_seedable():
    a = data.synthetic_pairs(300, seed=7)
    b = data.synthetic_pairs(300, seed=7)
    c = data.synthetic_pairs(300, seed=8)
    assert a.column_names == ["sentence1", "sentence2", "score"]
    assert len(a) == 300
    assert a[:] == b[:]
    assert a["sentence1"] != c["sentence1"]
    assert data.synthetic_pairs(50, seed=7)[:] == a.select(range(50))[:]  # prefix-stable
    assert all(isinstance(s, float) and 0.0 <= s <= 1.0 for s in a["score"])
    assert data.has_scores(a)
    distinct = set(a["sentence1"]) | set(a["sentence2"])
    assert len(distinct) > 400
    assert len(data.synthetic_pairs(0)) == 0


def test_synthetic_scores_follow_meaning():
    rows = data._synthetic_rows(2000, seed=0)
    by_k = {k: [r[2] for r in rows if r[3] == k] for k in range(5)}
    means = [statistics.mean(by_k[k]) for k in range(5)]
    assert means == sorted(means)  # more agreeing slots, higher score
    assert min(by_k[4]) >= 0.8 and means[4] > 0.9  # paraphrases
    assert max(by_k[0]) <= 0.2 and means[0] < 0.1  # unrelated
    assert 0.3 < means[2] < 0.7  # partial overlap in the middle
    # paraphrases really are reworded, not copies
    para = [r for r in rows if r[3] == 4]
    assert sum(r[0] != r[1] for r in para) > 0.8 * len(para)


def test_synthetic_scores_agree_with_a_real_model(minilm):
    ds = data.synthetic_pairs(200, seed=1)
    e1 = minilm.encode(ds["sentence1"], convert_to_tensor=True, batch_size=64)
    e2 = minilm.encode(ds["sentence2"], convert_to_tensor=True, batch_size=64)
    cos = torch.nn.functional.cosine_similarity(e1, e2)
    gold = torch.tensor(ds["score"], dtype=cos.dtype)
    r = torch.corrcoef(torch.stack([cos, gold]))[0, 1].item()
    assert r > 0.4, r


def test_load_pairs_synthetic_split():
    train, dev = data.load_pairs("synthetic", train_size=40, dev_size=10, seed=3)
    full = data.synthetic_pairs(50, seed=3)
    assert (len(train), len(dev)) == (40, 10)
    assert train[:] == full.select(range(40))[:]
    assert dev[:] == full.select(range(40, 50))[:]
    train2, dev2 = data.load_pairs("synthetic", train_size=40, dev_size=10, seed=3)
    assert train2[:] == train[:] and dev2[:] == dev[:]
    assert data.check_data("synthetic") is None


@pytest.mark.parametrize("loss", [None, "mnrl"])
def test_no_dev_rows_asked(loss, tmp_path):
    """dev_size=0 (with evaluate=False) gives train its rows and dev none, for synthetic data and a file
    (an empty range starting at the last row made datasets raise IndexError inside the ranks)."""
    train, dev = data.load_pairs("synthetic", train_size=32, dev_size=0, seed=0, loss=loss)
    assert (len(train), len(dev)) == (32, 0)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join('{"sentence1": "a%d", "sentence2": "b%d"}\n' % (i, i) for i in range(6)))
    train, dev = data.load_pairs(str(path), train_size=6, dev_size=0, seed=0, loss="mnrl")
    assert (len(train), len(dev)) == (6, 0)


# ---- files -------------------------------------------------------------------------------------

def _write_csv(path, header, rows):
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


def test_csv_sts_scale_scores(tmp_path):
    rows = [(f"first sentence {i}, with a comma", f"second sentence {i}", i % 6, "news") for i in range(12)]
    path = _write_csv(tmp_path / "sts.csv", ["sentence1", "sentence2", "score", "genre"], rows)
    with pytest.raises(ConfigError, match="'genre'"):  # a column no loss reads is never dropped silently
        data.check_data(path, "cosine")
    data.check_data(path, "cosine", {"genre": None})
    train, dev = data.load_pairs(path, train_size=8, dev_size=3, seed=0, loss="cosine", columns={"genre": None})
    assert (len(train), len(dev)) == (8, 3)
    assert train.column_names == ["sentence1", "sentence2", "score"]  # 'genre' dropped, as asked
    assert data.has_scores(train) and data.has_scores(dev)
    assert train[0]["sentence1"] == "first sentence 0, with a comma"
    assert train["score"] == pytest.approx([(i % 6) / 5 for i in range(8)])  # 0-5 scale -> [0, 1]
    assert dev["sentence2"] == [f"second sentence {i}" for i in range(8, 11)]


def test_jsonl_anchor_positive(tmp_path):
    path = tmp_path / "pairs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(6):
            f.write(json.dumps({"positive": f"answer {i}", "anchor": f"question {i}"}) + "\n")
    data.check_data(str(path), "mnrl")
    train, dev = data.load_pairs(str(path), train_size=4, dev_size=2, seed=0, loss="mnrl")
    assert train.column_names == ["anchor", "positive"]  # the order MNRL reads them, whatever the file's
    assert not data.has_scores(train)
    assert train["anchor"] == [f"question {i}" for i in range(4)]
    assert dev["positive"] == ["answer 4", "answer 5"]


def test_json_list_with_unit_scores(tmp_path):
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([{"sentence1": f"a {i}", "sentence2": f"b {i}", "score": i / 10} for i in range(5)]))
    data.check_data(str(path))
    train, dev = data.load_pairs(str(path), train_size=3, dev_size=2, seed=0)
    assert train["score"] == pytest.approx([0.0, 0.1, 0.2])  # already in [0, 1]: unchanged
    assert len(dev) == 2


def test_small_file_shrinks_dev_with_warning(tmp_path):
    path = _write_csv(tmp_path / "small.csv", ["sentence1", "sentence2"], [(f"x{i}", f"y{i}") for i in range(5)])
    with pytest.warns(UserWarning, match="fewer than train_size"):
        train, dev = data.load_pairs(path, train_size=100, dev_size=20, seed=0)
    assert (len(train), len(dev)) == (4, 1)


def test_missing_column(tmp_path):
    path = _write_csv(tmp_path / "bad.csv", ["text", "other", "score"], [("a", "b", 1)])
    with pytest.raises(ConfigError) as e:
        data.check_data(path)
    msg = str(e.value)
    assert path in msg and "sentence1" in msg and "anchor" in msg and "'text'" in msg and "columns={" in msg
    with pytest.raises(ConfigError, match="sentence1"):
        data.load_pairs(path, 2, 1, 0)


def test_empty_files(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ConfigError, match="has no rows") as e:
        data.check_data(str(empty))
    assert str(empty) in str(e.value)
    header_only = _write_csv(tmp_path / "header.csv", ["sentence1", "sentence2"], [])
    with pytest.raises(ConfigError, match="has no rows"):
        data.check_data(header_only)
    with pytest.raises(ConfigError, match="has no rows"):
        data.load_pairs(header_only, 2, 1, 0)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(ConfigError, match="has no rows"):
        data.check_data(str(blank))


def test_missing_and_bad_files(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError) as e:
        data.check_data(str(missing))
    assert str(missing) in str(e.value) and "does not exist" in str(e.value) and "synthetic" in str(e.value)
    with pytest.raises(ConfigError, match="does not exist"):
        data.load_pairs(str(missing), 2, 1, 0)

    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ConfigError, match="not valid"):
        data.check_data(str(broken))

    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("sentence1\tsentence2\na\tb\n")
    with pytest.raises(ConfigError, match="unsupported"):
        data.check_data(str(tsv))
    fake = tmp_path / "fake.parquet"
    fake.write_text("sentence1,sentence2\na,b\n")
    with pytest.raises(ConfigError, match="not valid Parquet"):
        data.check_data(str(fake))

    out_of_range = _write_csv(tmp_path / "range.csv", ["sentence1", "sentence2", "score"], [("a", "b", 7)])
    with pytest.raises(ConfigError, match="0-5"):
        data.load_pairs(out_of_range, 1, 0, 0)


def test_hub_names(tmp_path):
    for call in (lambda: data.check_data("sentence-transformers/stsb"),  # refused before any process
                 lambda: data.load_pairs("sentence-transformers/stsb", 10, 2, 0)):
        with pytest.raises(ConfigError) as e:
            call()
        msg = str(e.value)
        assert "'sentence-transformers/stsb'" in msg and "HF_HUB_OFFLINE=1" in msg
        assert "data='synthetic'" in msg and ".parquet" in msg
