"""The seed's benchmark recipe: NLI pairs with SoftmaxLoss and STS pairs with CosineSimilarityLoss, one run.

The sentence-transformers docs' distributed-training table (``stnb.reference``) trained MultiNLI + SNLI
with ``SoftmaxLoss`` and STSB with ``CosineSimilarityLoss`` in one multi-dataset run. stnb's loss
``'softmax+cosine'`` trains exactly that shape: a dict of two datasets and a dict of two losses (the keys
of ``PARTS``), one batch from one dataset at a time (sentence-transformers' default
``MultiDatasetBatchSampler``, PROPORTIONAL: each dataset in proportion to its rows). The dev evaluator is
STS Spearman (EmbeddingSimilarityEvaluator) on the STS dev rows.

``data`` for this loss:
    'synthetic'   offline stand-ins of the same shapes, from ``stnb.data.synthetic_pairs``:
                  'sts' rows are its scored pairs; 'nli' rows are an independent stream of the same
                  generator with a class label from the generator's own similarity score, in three
                  bands: score >= 0.7 -> 0 (entailment), score < 0.3 -> 2 (contradiction), else 1
                  (neutral): roughly a third each. They are similarity bands, not real inference.
    'hub'         the seed's own data (needs the internet or a cached copy):
                  ``sentence-transformers/all-nli`` (subset 'pair-class': premise, hypothesis, label
                  0/1/2) and ``sentence-transformers/stsb`` (its train and validation splits).
    'NLI+STS'     two sources joined by '+', each a file (.csv/.jsonl/.json/.parquet) or a hub dataset:
                  the NLI one with columns sentence1, sentence2, label; the STS one with sentence1,
                  sentence2, score.
train_size is split evenly: ceil(train_size / 2) NLI rows and floor(train_size / 2) STS rows (the
seed's data is ~99% NLI; an even split makes both losses run in a short benchmark, and every row of
either dataset costs the same: two texts through the model). dev_size STS rows are the dev set.
"""

from __future__ import annotations

from .columns import MULTI_LOSS_INPUTS
from .errors import ConfigError

NAME = "softmax+cosine"
SYNTHETIC, HUB = "synthetic", "hub"
#: the datasets of one run, in order: {name: the loss it trains with (its inputs: stnb.columns)}
PARTS = {part: inputs.loss for part, inputs in MULTI_LOSS_INPUTS[NAME].items()}
NUM_LABELS = 3  # entailment 0, neutral 1, contradiction 2 (all-nli pair-class's labels)
ENTAILMENT_SCORE, CONTRADICTION_SCORE = 0.7, 0.3
#: the hub variant: {part: (dataset id, its columns renamed to the ones the loss reads)}
HUB_DATASETS = {"nli": ("sentence-transformers/all-nli:pair-class", {"premise": "sentence1", "hypothesis": "sentence2"}),
                "sts": ("sentence-transformers/stsb", None)}
SHAPES = ("NLI rows (sentence1, sentence2, label 0/1/2) for SoftmaxLoss and STS rows (sentence1, sentence2, "
          "score) for CosineSimilarityLoss")
_FIX = ("use data='synthetic' (offline stand-ins), data='hub' (all-nli pair-class + stsb) or "
        "data='nli.csv+sts.csv' (two sources joined by '+')")


def part_inputs(part: str):
    """What the loss of dataset ``part`` reads (``stnb.columns.LossInputs``)."""
    return MULTI_LOSS_INPUTS[NAME][part]


def sources(data: str, columns=None) -> dict:
    """{part: (source, column mapping)} for ``data``; ConfigError naming the forms it takes."""
    if columns:
        raise ConfigError(f"loss={NAME!r} reads two datasets with fixed columns ({SHAPES}), so columns={columns!r} "
                          "cannot say which one it renames; give your files those column names and drop columns")
    if data == SYNTHETIC:
        return {part: (SYNTHETIC, None) for part in PARTS}
    if data == HUB:
        return dict(HUB_DATASETS)
    given = data.split("+") if isinstance(data, str) else []
    if len(given) != len(PARTS) or not all(s.strip() for s in given):
        raise ConfigError(f"loss={NAME!r} trains two datasets, {SHAPES}; data={data!r} is not one of the forms "
                          f"it takes: {_FIX}")
    return {part: (s.strip(), None) for part, s in zip(PARTS, given)}


def check(data: str, columns=None) -> None:
    """Before any process starts: each source exists and holds exactly the columns its loss reads
    (ConfigError naming the columns found, the ones expected, and the fix)."""
    from .data import check_data

    for part, (source, mapping) in sources(data, columns).items():
        if source == SYNTHETIC:
            continue
        try:
            check_data(source, part_inputs(part), mapping)
        except ConfigError as e:
            raise ConfigError(f"loss={NAME!r}, its {part!r} dataset ({PARTS[part]}): {e}"
                              + ("" if data == HUB else " (with this loss, name the columns in the file itself: "
                                 "columns= cannot say which dataset it maps)")) from e


def split_train_size(train_size: int) -> dict:
    """{part: rows}: ceil(train_size / 2) NLI rows, floor(train_size / 2) STS rows."""
    return {"nli": train_size - train_size // 2, "sts": train_size // 2}


def nli_label(score: float) -> int:
    """The synthetic NLI label of a pair from its similarity score (the generator's own)."""
    return 0 if score >= ENTAILMENT_SCORE else 2 if score < CONTRADICTION_SCORE else 1


def synthetic_nli(n: int, seed: int):
    """SYNTHETIC NLI-shaped pairs: sentence1, sentence2, label (0 entailment, 1 neutral, 2 contradiction),
    the label from the pair's similarity score in bands (see the module's docstring). A stream of
    ``stnb.data.synthetic_pairs`` of its own (not the STS rows)."""
    from .data import synthetic_pairs

    ds = synthetic_pairs(n, f"nli:{seed}")
    return ds.remove_columns("score").add_column("label", [nli_label(s) for s in ds["score"]])


def load(data: str, train_size: int, dev_size: int, seed: int, columns=None):
    """(DatasetDict {'nli', 'sts'} of train rows, the STS dev Dataset) for ``data``."""
    import datasets

    from .data import load_pairs

    rows = split_train_size(train_size)
    train, dev = {}, None
    for part, (source, mapping) in sources(data, columns).items():
        if source == SYNTHETIC and part == "nli":
            train[part] = synthetic_nli(rows[part], seed)
            continue
        # synthetic STS rows: stnb.data's scored pairs (dev: the rows after train)
        reads = "cosine" if source == SYNTHETIC else part_inputs(part)
        try:
            train[part], part_dev = load_pairs(source, rows[part], dev_size if part == "sts" else 0, seed, reads,
                                               mapping)
        except ConfigError as e:
            raise ConfigError(f"loss={NAME!r}, its {part!r} dataset ({PARTS[part]}): {e}") from e
        if part == "sts":
            dev = part_dev
    return datasets.DatasetDict(train), dev


def make_losses(model) -> dict:
    """{'nli': SoftmaxLoss(model, dim, num_labels=3), 'sts': CosineSimilarityLoss(model)}."""
    from sentence_transformers.sentence_transformer import losses

    dim = (getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension)()
    return {"nli": losses.SoftmaxLoss(model, dim, num_labels=NUM_LABELS),
            "sts": losses.CosineSimilarityLoss(model)}
