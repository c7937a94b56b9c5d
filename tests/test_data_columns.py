"""Data keeps what the loss reads: real CSV / JSONL / Parquet files written here, column mappings,
refusals that name the columns and the fix, and a real 2-rank DDP run where the hard negative
demonstrably reaches MultipleNegativesRankingLoss.
"""

from __future__ import annotations

import csv
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

import stnb
from stnb import columns, data
from stnb.errors import ConfigError

N = 12


def _rows(kind: str, n: int = N) -> list[dict]:
    if kind == "triplets":
        return [{"anchor": f"question {i}", "positive": f"answer {i}", "negative": f"wrong answer {i}"}
                for i in range(n)]
    if kind == "pairs":
        return [{"anchor": f"question {i}", "positive": f"answer {i}"} for i in range(n)]
    if kind == "scored":
        return [{"sentence1": f"first {i}", "sentence2": f"second {i}", "score": i % 6} for i in range(n)]
    raise ValueError(kind)


def _write(path, rows: list[dict]) -> str:
    """Write rows as CSV, JSONL or Parquet, by the file's suffix."""
    path = str(path)
    if path.endswith(".csv"):
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    elif path.endswith(".jsonl"):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    else:
        import pandas as pd

        pd.DataFrame(rows).to_parquet(path)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_triplets_keep_the_negative(tmp_path, suffix):
    path = _write(tmp_path / f"triplets{suffix}", _rows("triplets"))
    data.check_data(path, "mnrl")
    train, dev = data.load_pairs(path, train_size=8, dev_size=4, seed=0, loss="mnrl")
    assert train.column_names == ["anchor", "positive", "negative"]
    assert train["negative"] == [f"wrong answer {i}" for i in range(8)]
    assert dev["negative"] == [f"wrong answer {i}" for i in range(8, 12)]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_pairs_and_scored_pairs(tmp_path, suffix):
    pairs = _write(tmp_path / f"pairs{suffix}", _rows("pairs"))
    train, _ = data.load_pairs(pairs, 8, 4, 0, loss="mnrl")
    assert train.column_names == ["anchor", "positive"]
    scored = _write(tmp_path / f"scored{suffix}", _rows("scored"))
    train, dev = data.load_pairs(scored, 8, 4, 0, loss="cosine")
    assert train.column_names == ["sentence1", "sentence2", "score"]
    assert train["score"] == pytest.approx([(i % 6) / 5 for i in range(8)])  # 0-5 scale -> [0, 1]
    # the loss decides what fits: each mismatch is refused, naming the other loss
    with pytest.raises(ConfigError, match="loss='cosine'"):
        data.load_pairs(scored, 8, 4, 0, loss="mnrl")
    with pytest.raises(ConfigError, match="loss='mnrl'"):
        data.load_pairs(pairs, 8, 4, 0, loss="cosine")


def test_column_order_follows_the_loss_not_the_file(tmp_path):
    rows = [{"negative_2": f"n2 {i}", "positive": f"p {i}", "negative_1": f"n1 {i}", "anchor": f"a {i}"}
            for i in range(N)]
    path = _write(tmp_path / "multi.jsonl", rows)
    train, _ = data.load_pairs(path, 8, 4, 0, loss="mnrl")
    assert train.column_names == ["anchor", "positive", "negative_1", "negative_2"]
    assert train[0] == {"anchor": "a 0", "positive": "p 0", "negative_1": "n1 0", "negative_2": "n2 0"}


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_mapping_renames_and_drops_explicitly(tmp_path, suffix):
    rows = [{"id": i, "question": f"q {i}", "answer": f"a {i}", "hard": f"h {i}", "similarity": i / N}
            for i in range(N)]
    path = _write(tmp_path / f"qa{suffix}", rows)
    mapping = {"id": None, "question": "anchor", "answer": "positive", "hard": "negative", "similarity": None}
    data.check_data(path, "mnrl", mapping)
    train, _ = data.load_pairs(path, 8, 4, 0, loss="mnrl", columns=mapping)
    assert train.column_names == ["anchor", "positive", "negative"]
    assert train[3] == {"anchor": "q 3", "positive": "a 3", "negative": "h 3"}
    # the same file as scored pairs for the cosine loss
    as_pairs = {"id": None, "question": "sentence1", "answer": "sentence2", "hard": None, "similarity": "score"}
    train, _ = data.load_pairs(path, 8, 4, 0, loss="cosine", columns=as_pairs)
    assert train.column_names == ["sentence1", "sentence2", "score"]
    assert train["score"] == pytest.approx([i / N for i in range(8)])
    # leaving one column out of the mapping is refused, naming it
    partial = {k: v for k, v in mapping.items() if k != "id"}
    with pytest.raises(ConfigError) as e:
        data.check_data(path, "mnrl", partial)
    msg = str(e.value)
    assert "['id'] are not inputs" in msg and "columns={'id': None}" in msg and "'question'" in msg


def test_extra_columns_are_refused_not_dropped(tmp_path):
    rows = [dict(r, source="web") for r in _rows("triplets")]
    path = _write(tmp_path / "extra.csv", rows)
    with pytest.raises(ConfigError) as e:
        data.load_pairs(path, 8, 4, 0, loss="mnrl")
    msg = str(e.value)
    assert path in msg and "['anchor', 'positive', 'negative', 'source']" in msg
    assert "(anchor, positive[, negative_1, ..., negative_n])" in msg and "columns={'source': None}" in msg


def test_missing_positive_is_refused(tmp_path):
    path = _write(tmp_path / "no_positive.jsonl", [{"anchor": "a", "negative": "n"}] * 4)
    with pytest.raises(ConfigError, match=r"\['positive'\] are missing"):
        data.check_data(path, "mnrl")


def test_synthetic_train_rows_fit_the_loss():
    train, dev = data.load_pairs("synthetic", 40, 10, 3, loss="mnrl")
    assert train.column_names == ["anchor", "positive"]  # paraphrases: every row a true positive pair
    assert all(a != p for a, p in zip(train["anchor"], train["positive"]))
    assert train[:] == data.synthetic_positives(40, seed=3)[:]
    cos_train, cos_dev = data.load_pairs("synthetic", 40, 10, 3, loss="cosine")
    assert cos_train.column_names == ["sentence1", "sentence2", "score"]
    assert dev[:] == cos_dev[:]  # the same scored dev pairs, whatever the loss: comparable Spearman


def test_label_names_match_the_trainer():
    from sentence_transformers.base.data_collator import DEFAULT_LABEL_COLUMNS

    assert columns.LABEL_COLUMNS == DEFAULT_LABEL_COLUMNS


def test_loss_objects_are_looked_up_through_wrappers():
    from sentence_transformers.sentence_transformer import losses

    from stnb.models import load_model

    model = load_model("tiny")
    mnrl = losses.MultipleNegativesRankingLoss(model)
    assert columns.loss_inputs(losses.MatryoshkaLoss(model, mnrl, [32, 16])).loss == "MultipleNegativesRankingLoss"
    assert columns.loss_inputs(losses.TripletLoss(model)).max_texts == 3
    plan = columns.plan_columns(["anchor", "positive", "negative"], losses.TripletLoss(model))
    assert plan.texts == ("anchor", "positive", "negative") and plan.label is None
    with pytest.raises(ConfigError, match="TripletLoss"):
        columns.plan_columns(["anchor", "positive"], losses.TripletLoss(model))
    with pytest.raises(ConfigError, match="CoSENTLoss takes|no label column"):
        columns.plan_columns(["sentence1", "sentence2"], losses.CoSENTLoss(model))


# ---- a real run: the hard negative reaches the loss ---------------------------------------------

RUN = dict(model="tiny", strategy="ddp", num_processes=2, device="cpu", per_device_batch_size=4, steps=3,
           warmup_steps_excluded=1, loss="mnrl", seed=7)


@pytest.fixture(scope="module")
def triplet_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("triplet_run")
    path = _write(folder / "triplets.jsonl", _rows("triplets", 40))
    cfg = stnb.TrainConfig(data=path, train_size=32, dev_size=8, **RUN)
    with_negatives = stnb.run(cfg, echo=False)
    without = stnb.run(cfg.replace(columns={"negative": None}), echo=False)
    return with_negatives, without


def test_ddp_triplets_feed_the_negative_to_the_loss(triplet_runs):
    r, _ = triplet_runs
    assert r.verified and r.world_size == 2
    v = r.verification
    assert v["data_columns"] == ["anchor", "positive", "negative"]
    # what MultipleNegativesRankingLoss received at its first call, in each rank: 3 texts, no label
    assert v["loss_inputs"] == [{"texts": 3, "label": False}] * 2
    assert v["loss_received_all_columns"] is True
    assert r.dev_metric == "dev_cosine_accuracy"  # TripletEvaluator on the dev triplets
    assert 0.0 <= r.dev_metric_before <= 1.0 and 0.0 <= r.dev_metric_after <= 1.0
    assert r.spearman_before is None and r.config["columns"] is None


def test_dropping_the_negative_changes_the_training(triplet_runs):
    with_negatives, without = triplet_runs
    assert without.verification["data_columns"] == ["anchor", "positive"]
    assert without.verification["loss_inputs"] == [{"texts": 2, "label": False}] * 2
    assert without.config["columns"] == {"negative": None}  # the drop was asked for, and recorded
    assert without.dev_metric == "dev_cosine_ndcg@10"  # unscored pairs: retrieval among the dev positives
    # same seed, same rows, same order: only the negatives differ, and the loss sees it from step 1
    assert with_negatives.losses[0] != pytest.approx(without.losses[0], rel=1e-4)


# ---- the words of a refusal: the columns found, what the loss reads, and the fix --------------------

HEAD = "data data has columns {found}; loss {loss!r} ({name}) reads {shape}. "
MNRL_SHAPE = "(anchor, positive[, negative_1, ..., negative_n])"


@pytest.mark.parametrize("found, loss, message", [
    (["anchor", "positive", "score"], "mnrl",
     HEAD.format(found=["anchor", "positive", "score"], loss="mnrl", name="MultipleNegativesRankingLoss",
                 shape=MNRL_SHAPE)
     + "MultipleNegativesRankingLoss takes no label: it treats every row as a positive pair, so the 'score' column "
       "would be ignored and low-score rows trained as positives; use loss='cosine' (CosineSimilarityLoss, which "
       "trains on it), or drop it explicitly with columns={'score': None}"),
    (["sentence1", "sentence2"], "cosine",
     HEAD.format(found=["sentence1", "sentence2"], loss="cosine", name="CosineSimilarityLoss",
                 shape="(sentence1, sentence2, score)")
     + "There is no label column (label, labels, score, scores); add a score column or map yours, e.g. "
       "columns={'similarity': 'score'}, or use loss='mnrl' (MultipleNegativesRankingLoss, which needs none)"),
    (["anchor", "positive", "negative"], "cosine",
     HEAD.format(found=["anchor", "positive", "negative"], loss="cosine", name="CosineSimilarityLoss",
                 shape="(sentence1, sentence2, score)")
     + "The column(s) ['negative'] would not be used by CosineSimilarityLoss; use loss='mnrl' "
       "(MultipleNegativesRankingLoss, which uses them), or drop them explicitly with columns={'negative': None}"),
])
def test_refusals_suggest_the_stnb_loss_that_fits_the_data(found, loss, message):
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(found, loss)
    assert str(e.value) == message


def test_a_loss_object_gets_no_stnb_loss_suggested():
    class MultipleNegativesRankingLoss:  # a user's loss object: looked up by its class name
        pass

    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["anchor", "positive", "score"], MultipleNegativesRankingLoss())
    assert str(e.value).endswith("low-score rows trained as positives, or drop it explicitly with "
                                 "columns={'score': None}")
    assert "use loss=" not in str(e.value)


def test_no_stnb_loss_is_suggested_when_none_fits():
    """Triplets with a score: mnrl takes no label and cosine takes two texts; neither is offered."""
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["anchor", "positive", "negative", "score"], "mnrl")
    assert "use loss=" not in str(e.value)
    assert str(e.value).endswith("low-score rows trained as positives, or drop it explicitly with "
                                 "columns={'score': None}")


def test_text_columns_leave_out_the_labels():
    from datasets import Dataset

    ds = Dataset.from_dict({"score": [0.5], "sentence1": ["a"], "label": [1], "sentence2": ["b"]})
    assert columns.text_columns(ds) == ["sentence1", "sentence2"]


# ---- plan_columns: what goes to the loss, and each refusal's words ------------------------------------

NAMES_ONLY = ("stnb reads text columns named sentence1,sentence2 or anchor,positive[,negative_1..n] plus an "
              "optional score")
COSINE = "loss 'cosine' (CosineSimilarityLoss) reads (sentence1, sentence2, score)"
MNRL = f"loss 'mnrl' (MultipleNegativesRankingLoss) reads {MNRL_SHAPE}"
KNOWN = "sentence1, sentence2, anchor, positive, negative / negative_1..n, score"


def test_a_plan_orders_texts_as_the_loss_reads_them_then_the_label_and_keeps_the_mapping():
    plan = columns.plan_columns(["sim", "b", "id", "a"], "cosine",
                                {"a": "sentence1", "b": "sentence2", "sim": "score", "id": None})
    assert (plan.texts, plan.label) == (("sentence1", "sentence2"), "score")
    assert plan.rename == {"a": "sentence1", "b": "sentence2", "sim": "score"} and plan.dropped == ("id",)
    assert plan.keep == ["sentence1", "sentence2", "score"]
    # negatives in their number's order (negative_10 after negative_2), after anchor and positive
    found = ["negative_10", "positive", "negative_2", "anchor", "negative"]
    assert columns.plan_columns(found, "mnrl").texts == ("anchor", "positive", "negative", "negative_2",
                                                         "negative_10")
    # a name mapped to itself is no rename; a plan without label keeps only the texts
    plan = columns.plan_columns(["anchor", "positive"], "mnrl", {"anchor": "anchor"})
    assert (plan.rename, plan.dropped, plan.label, plan.keep) == ({}, (), None, ["anchor", "positive"])
    # names only (no loss): the label is optional and found by the trainer's preference
    assert columns.plan_columns(["labels", "sentence2", "sentence1"]).keep == ["sentence1", "sentence2", "labels"]


def test_a_mapping_is_a_dict_of_names_and_it_maps_only_columns_the_data_has():
    for bad in (["anchor"], {"q": 1}, {2: "anchor"}):
        with pytest.raises(ConfigError) as e:
            columns.plan_columns(["q", "a"], "mnrl", bad)
        assert str(e.value) == ("columns must be a dict {column in the data: name the loss reads, or None to drop it}, "
                                "e.g. columns={'question': 'anchor', 'answer': 'positive'}; got " + repr(bad))
    assert columns.check_mapping(None) == {} and columns.check_mapping({"q": None}) == {"q": None}
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["q", "a"], "mnrl", {"x": "anchor", "q": "anchor", "y": None}, where="train.csv")
    assert str(e.value) == ("train.csv: columns={'x': 'anchor', 'q': 'anchor', 'y': None} maps ['x', 'y'], which the "
                            "data does not have; its columns are ['q', 'a']. Map only existing columns.")
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["a", "b", "c"], "cosine", {"a": "sentence1", "b": "sentence2", "c": "sentence1"})
    assert str(e.value) == ("data: with columns={'a': 'sentence1', 'b': 'sentence2', 'c': 'sentence1'} the data "
                            "['a', 'b', 'c'] would have the column(s) ['sentence1'] more than once; map each input "
                            "to one column")


def test_two_label_columns_are_refused_naming_the_data_columns_to_drop():
    mapping = {"s1": "sentence1", "s2": "sentence2", "sim": "score"}
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["s1", "s2", "scores", "sim", "label"], "cosine", mapping, where="sts.csv")
    assert str(e.value) == (
        "data sts.csv has columns ['s1', 's2', 'scores', 'sim', 'label'] (after columns=" + repr(mapping)
        + ": ['sentence1', 'sentence2', 'scores', 'score', 'label']); " + COSINE + ". It has 3 label columns "
        "['label', 'score', 'scores'], and the trainer would use only 'label'; keep one, e.g. drop the others with "
        "columns={'sim': None, 'scores': None}")


@pytest.mark.parametrize("found, loss, first", [(["sentence1", "sentence2", "extra", "more"], "cosine", "sentence1"),
                                                (["anchor", "extra", "more"], None, "anchor")])
def test_an_unknown_column_is_refused_with_a_name_the_loss_reads_or_a_drop(found, loss, first):
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(found, loss)
    expects = COSINE if loss else NAMES_ONLY
    assert str(e.value) == (f"data data has columns {found}; {expects}. The column(s) ['extra', 'more'] are not "
                            f"inputs stnb knows ({KNOWN}), and nothing is dropped silently: say what each one is "
                            f"with columns={{'extra': '{first}'}} (any of those names), or drop it explicitly with "
                            "columns={'extra': None}")


def test_a_missing_input_and_no_text_at_all_are_refused_with_the_fix():
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["anchor", "negative"], "mnrl")
    assert str(e.value) == (f"data data has columns ['anchor', 'negative']; {MNRL}. The input(s) ['positive'] are "
                            "missing (the trainer reads inputs by position, so anchor and negative alone would be "
                            "read as the wrong inputs); add them, or map yours, e.g. columns={'answer': 'positive'}")
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["score"], "cosine")
    assert str(e.value) == (f"data data has columns ['score']; {COSINE}. It has no text columns; name them with e.g. "
                            "columns={'question': 'anchor', 'answer': 'positive'}, or use data='synthetic'")
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["sentence1", "sentence2"], "nope")
    assert str(e.value) == "unknown loss 'nope'; choose one of 'cosine', 'mnrl'"


def test_extra_texts_and_labels_are_named_by_the_data_columns_they_come_from():
    mapping = {"q": "anchor", "p": "positive", "h": "negative", "h2": "negative_2"}
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["q", "p", "h", "h2"], "cosine", mapping)
    assert str(e.value).endswith("The column(s) ['negative', 'negative_2'] would not be used by CosineSimilarityLoss; "
                                 "use loss='mnrl' (MultipleNegativesRankingLoss, which uses them), or drop them "
                                 "explicitly with columns={'h': None, 'h2': None}")
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["q", "p", "sim"], "mnrl", {"q": "anchor", "p": "positive", "sim": "labels"})
    assert str(e.value).endswith("so the 'labels' column would be ignored and low-labels rows trained as positives; "
                                 "use loss='cosine' (CosineSimilarityLoss, which trains on it), or drop it "
                                 "explicitly with columns={'sim': None}")


def test_loss_objects_name_their_class_the_inputs_missing_and_the_label_kind_they_need():
    from sentence_transformers.sentence_transformer import losses

    from stnb.models import load_model

    model = load_model("tiny")
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["anchor", "positive"], losses.TripletLoss(model))
    assert str(e.value) == ("data data has columns ['anchor', 'positive']; loss TripletLoss reads (anchor, positive, "
                            "negative). It has 2 text column(s) ['anchor', 'positive']; add or map the missing "
                            "input(s)")
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["sentence1", "sentence2"], losses.ContrastiveLoss(model))
    assert str(e.value) == ("data data has columns ['sentence1', 'sentence2']; loss ContrastiveLoss reads (sentence1, "
                            "sentence2, label 0/1). There is no label column (label, labels, score, scores); add a "
                            "class column or map yours, e.g. columns={'gold': 'label'}")
    assert columns.plan_columns(["sentence1", "sentence2", "label"], losses.ContrastiveLoss(model)).label == "label"
    # a loss stnb does not know: only the names are checked; a loss wrapping itself does not loop
    class Mine:
        pass

    looped = Mine()
    looped.loss = looped
    assert columns.loss_inputs(Mine()) is None and columns.loss_inputs(looped) is None
    assert columns.plan_columns(["anchor", "positive", "score"], Mine()).keep == ["anchor", "positive", "score"]
    li = columns.LOSS_INPUTS["mnrl"]
    assert columns.loss_inputs(li) is li and columns.loss_inputs("cosine") is columns.LOSS_INPUTS["cosine"]


def test_a_names_only_plan_keeps_the_mapping_and_a_plain_negative_comes_before_negative_1():
    plan = columns.plan_columns(["q", "a", "id"], None, {"q": "anchor", "a": "positive", "id": None})
    assert (plan.texts, plan.rename, plan.dropped) == (("anchor", "positive"), {"q": "anchor", "a": "positive"},
                                                        ("id",))
    assert columns.plan_columns(["anchor", "positive", "negative_1", "negative"], "mnrl").texts == (
        "anchor", "positive", "negative", "negative_1")


def test_two_label_columns_are_refused_and_extra_texts_with_a_label_get_no_loss_suggested():
    with pytest.raises(ConfigError) as e:
        columns.plan_columns(["sentence1", "sentence2", "label", "score"], "cosine")
    assert str(e.value).endswith("It has 2 label columns ['label', 'score'], and the trainer would use only 'label'; "
                                 "keep one, e.g. drop the others with columns={'score': None}")
    with pytest.raises(ConfigError) as e:  # mnrl would take the texts but not the score: not offered
        columns.plan_columns(["anchor", "positive", "negative", "score"], "cosine")
    assert str(e.value).endswith("The column(s) ['negative'] would not be used by CosineSimilarityLoss, or drop them "
                                 "explicitly with columns={'negative': None}")
