"""Which dataset columns a loss reads, and a check that a dataset has exactly those.

The sentence-transformers trainer hands the loss every non-label column, in column order, as a
text input, and the first column named 'label', 'labels', 'score' or 'scores' as the label. So a
column the loss does not expect is not harmless: an extra text column becomes one more input
(e.g. a hard negative), and a score given to a loss without labels is ignored. ``plan_columns``
decides, before any process starts, which columns go to the loss and in which order, and refuses
anything else with the columns found, the ones the loss expects, and the fix.

Text columns are recognised by name (after the user's mapping, ``columns={'question': 'anchor'}``):
    sentence1, sentence2                               (pairs, STS style)
    anchor, positive[, negative | negative_1, ..., negative_n]   (retrieval style)
Any other name must be mapped to one of these, or dropped explicitly with ``{name: None}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import ConfigError, unknown_choice

# The trainer's label column names, in its order of preference
# (sentence_transformers.base.data_collator.DEFAULT_LABEL_COLUMNS; a test keeps them equal).
LABEL_COLUMNS = ("label", "labels", "score", "scores")
PAIR = ("sentence1", "sentence2")
RETRIEVAL = ("anchor", "positive")
_NEGATIVE = re.compile(r"^negative(?:_(\d+))?$")
INPUT_NAMES = "sentence1, sentence2, anchor, positive, negative / negative_1..n, score"


@dataclass(frozen=True)
class LossInputs:
    """What a loss reads from each row: 1..n text columns in order, and an optional label."""

    loss: str                     # class name, e.g. 'MultipleNegativesRankingLoss'
    min_texts: int
    max_texts: int | None         # None: any number of negatives
    label: str | None             # 'score' (a float similarity), 'class' (an integer) or None
    shape: str                    # for messages, e.g. '(anchor, positive[, negative_1, ..., negative_n])'


_TRIPLETS = "(anchor, positive[, negative_1, ..., negative_n])"
_SCORED = "(sentence1, sentence2, score)"
# stnb's loss names (TrainConfig.loss)
LOSS_INPUTS = {
    "cosine": LossInputs("CosineSimilarityLoss", 2, 2, "score", _SCORED),
    "mnrl": LossInputs("MultipleNegativesRankingLoss", 2, None, None, _TRIPLETS),
}
# sentence-transformers loss classes whose inputs are fixed (from their docstrings' Inputs tables);
# wrappers (MatryoshkaLoss, AdaptiveLayerLoss, ...) are looked through via their ``.loss``.
_ST_LOSS_INPUTS = {
    "CosineSimilarityLoss": LOSS_INPUTS["cosine"],
    "CoSENTLoss": LossInputs("CoSENTLoss", 2, 2, "score", _SCORED),
    "MultipleNegativesRankingLoss": LOSS_INPUTS["mnrl"],
    "CachedMultipleNegativesRankingLoss": LossInputs("CachedMultipleNegativesRankingLoss", 2, None, None, _TRIPLETS),
    "GISTEmbedLoss": LossInputs("GISTEmbedLoss", 2, None, None, _TRIPLETS),
    "CachedGISTEmbedLoss": LossInputs("CachedGISTEmbedLoss", 2, None, None, _TRIPLETS),
    "MultipleNegativesSymmetricRankingLoss": LossInputs("MultipleNegativesSymmetricRankingLoss", 2, 2, None,
                                                        "(anchor, positive)"),
    "CachedMultipleNegativesSymmetricRankingLoss": LossInputs("CachedMultipleNegativesSymmetricRankingLoss", 2, 2,
                                                              None, "(anchor, positive)"),
    "MegaBatchMarginLoss": LossInputs("MegaBatchMarginLoss", 2, 2, None, "(anchor, positive)"),
    "TripletLoss": LossInputs("TripletLoss", 3, 3, None, "(anchor, positive, negative)"),
    "ContrastiveLoss": LossInputs("ContrastiveLoss", 2, 2, "class", "(sentence1, sentence2, label 0/1)"),
    "OnlineContrastiveLoss": LossInputs("OnlineContrastiveLoss", 2, 2, "class", "(sentence1, sentence2, label 0/1)"),
    "SoftmaxLoss": LossInputs("SoftmaxLoss", 2, 2, "class", "(sentence1, sentence2, label)"),
}
# stnb's multi-dataset losses (TrainConfig.loss): {name: {dataset: what its loss reads}}, one run
# training one loss per dataset (stnb.seed_recipe)
MULTI_LOSS_INPUTS = {
    "softmax+cosine": {"nli": _ST_LOSS_INPUTS["SoftmaxLoss"], "sts": LOSS_INPUTS["cosine"]},
}


def loss_inputs(loss) -> LossInputs | None:
    """The inputs of an stnb loss name ('cosine', 'mnrl'), a sentence-transformers loss object, or a
    LossInputs (returned as it is).

    None for a loss object whose inputs stnb does not know (then only the column names are checked).
    """
    if isinstance(loss, LossInputs):
        return loss
    if isinstance(loss, str):
        if loss not in LOSS_INPUTS:
            raise unknown_choice("loss", loss, LOSS_INPUTS)
        return LOSS_INPUTS[loss]
    seen = set()
    while loss is not None and id(loss) not in seen:
        seen.add(id(loss))
        found = _ST_LOSS_INPUTS.get(type(loss).__name__)
        if found is not None:
            return found
        loss = getattr(loss, "loss", None)  # MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), ...)
    return None


@dataclass(frozen=True)
class ColumnPlan:
    """What goes to the loss: text columns in the order it reads them, then the label column.

    Names are after ``rename`` (the user's mapping); ``dropped`` are the columns the user dropped
    explicitly with ``{name: None}``.
    """

    texts: tuple
    label: str | None = None
    rename: dict = field(default_factory=dict)
    dropped: tuple = ()

    @property
    def keep(self) -> list:
        return list(self.texts) + ([self.label] if self.label else [])


def check_mapping(columns) -> dict:
    """A column mapping must be a dict {column in the data: new name or None (drop)}; returns it."""
    if columns is None:
        return {}
    if not isinstance(columns, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, str))
                                                 for k, v in columns.items()):
        raise ConfigError(f"columns must be a dict {{column in the data: name the loss reads, or None to drop "
                          f"it}}, e.g. columns={{'question': 'anchor', 'answer': 'positive'}}; got {columns!r}")
    return dict(columns)


def plan_columns(found, loss=None, columns=None, where: str = "data") -> ColumnPlan:
    """Check that columns ``found`` (after the mapping ``columns``) are exactly what ``loss`` reads.

    loss: an stnb loss name, a sentence-transformers loss object, or None (names only).
    Raises ConfigError naming the columns found, the inputs the loss expects and the fix; never
    drops a column the user did not drop.
    """
    found = list(found)
    mapping = check_mapping(columns)
    missing = [k for k in mapping if k not in found]
    if missing:
        raise ConfigError(f"{where}: columns={mapping!r} maps {missing}, which the data does not have; its "
                          f"columns are {found}. Map only existing columns.")
    renamed = [mapping.get(c, c) for c in found]
    kept = [n for n in renamed if n is not None]
    dupes = sorted({n for n in kept if kept.count(n) > 1})
    if dupes:
        raise ConfigError(f"{where}: with columns={mapping!r} the data {found} would have the column(s) {dupes} "
                          "more than once; map each input to one column")
    rename = {k: v for k, v in mapping.items() if v is not None and v != k}
    source = {v: k for k, v in rename.items()}  # suggestions name the data's own columns
    dropped = tuple(k for k, v in mapping.items() if v is None)
    li = loss_inputs(loss) if loss is not None else None
    expects = (f"loss {_loss_label(loss, li)} reads {li.shape}" if li is not None
               else f"stnb reads text columns named {PAIR[0]},{PAIR[1]} or {RETRIEVAL[0]},{RETRIEVAL[1]}"
                    "[,negative_1..n] plus an optional score")
    shown = f"{found}" + (f" (after columns={mapping!r}: {kept})" if mapping else "")
    head = f"data {where} has columns {shown}; {expects}"

    labels = [n for n in LABEL_COLUMNS if n in kept]  # in the trainer's order of preference
    if len(labels) > 1:
        raise ConfigError(f"{head}. It has {len(labels)} label columns {labels}, and the trainer would use only "
                          f"{labels[0]!r}; keep one, e.g. drop the others with "
                          f"columns={{{', '.join(f'{source.get(n, n)!r}: None' for n in labels[1:])}}}")
    label = labels[0] if labels else None
    texts, unknown, absent = _text_layout([n for n in kept if n != label])
    if unknown:
        u = unknown[0]
        first = li.shape[1:].split(",")[0] if li is not None else RETRIEVAL[0]  # e.g. 'sentence1' for cosine
        raise ConfigError(f"{head}. The column(s) {unknown} are not inputs stnb knows ({INPUT_NAMES}), and "
                          f"nothing is dropped silently: say what each one is with columns={{{u!r}: {first!r}}} "
                          f"(any of those names), or drop it explicitly with columns={{{u!r}: None}}")
    if absent:
        raise ConfigError(f"{head}. The input(s) {absent} are missing (the trainer reads inputs by position, so "
                          f"{' and '.join(texts)} alone would be read as the wrong inputs); add them, or map yours, "
                          f"e.g. columns={{'answer': {absent[0]!r}}}")
    if not texts:
        raise ConfigError(f"{head}. It has no text columns; name them with e.g. "
                          "columns={'question': 'anchor', 'answer': 'positive'}, or use data='synthetic'")
    if li is None:
        return ColumnPlan(tuple(texts), label, rename, dropped)

    n = len(texts)
    if n < li.min_texts:
        raise ConfigError(f"{head}. It has {n} text column(s) {texts}; add or map the missing input(s)"
                          + _other_losses(loss, n, label))
    if li.max_texts is not None and n > li.max_texts:
        extra = texts[li.max_texts:]
        raise ConfigError(f"{head}. The column(s) {extra} would not be used by {li.loss}"
                          + _other_losses(loss, n, label, "which uses them")
                          + f", or drop them explicitly with columns={{{', '.join(f'{source.get(c, c)!r}: None' for c in extra)}}}")
    if li.label is None and label is not None:
        raise ConfigError(f"{head}. {li.loss} takes no label: it treats every row as a positive pair, so the "
                          f"{label!r} column would be ignored and low-{label} rows trained as positives"
                          + _other_losses(loss, n, label, "which trains on it")
                          + f", or drop it explicitly with columns={{{source.get(label, label)!r}: None}}")
    if li.label is not None and label is None:
        raise ConfigError(f"{head}. There is no label column ({', '.join(LABEL_COLUMNS)}); add a {li.label} "
                          f"column or map yours, e.g. columns={{{'similarity' if li.label == 'score' else 'gold'!r}: "
                          f"{'score' if li.label == 'score' else 'label'!r}}}"
                          + _other_losses(loss, n, label, "which needs none").replace("; use", ", or use", 1))
    return ColumnPlan(tuple(texts), label, rename, dropped)


def _loss_label(loss, li: LossInputs) -> str:
    return f"{loss!r} ({li.loss})" if isinstance(loss, str) else li.loss


def _other_losses(loss, n_texts: int, label, why: str = "") -> str:
    """'; use loss='mnrl' (...)' for the stnb losses that take this shape of data ('' if none)."""
    if not isinstance(loss, str):
        return ""
    fits = [name for name, li in LOSS_INPUTS.items() if name != loss and li.min_texts <= n_texts
            and (li.max_texts is None or n_texts <= li.max_texts) and (li.label is None) == (label is None)]
    return "".join(f"; use loss={name!r} ({LOSS_INPUTS[name].loss}{', ' + why if why else ''})" for name in fits[:1])


def _text_layout(names: list) -> tuple[list, list, list]:
    """(text columns in the order the loss reads them, names that are not text inputs,
    inputs of the layout that are missing)."""
    if any(n in PAIR for n in names):
        layout, texts = PAIR, [n for n in PAIR if n in names]
    elif any(n in RETRIEVAL or _NEGATIVE.match(n) for n in names):
        negatives = sorted((n for n in names if _NEGATIVE.match(n)),
                           key=lambda n: int(_NEGATIVE.match(n).group(1) or 0))
        layout, texts = RETRIEVAL, [n for n in RETRIEVAL if n in names] + negatives
    else:
        layout, texts = (), []
    return texts, [n for n in names if n not in texts], [n for n in layout if n not in texts]


def text_columns(dataset) -> list:
    """A prepared dataset's text columns, in the order the trainer passes them to the loss."""
    return [c for c in dataset.column_names if c not in LABEL_COLUMNS]
