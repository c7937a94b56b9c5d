"""What the six example scripts take from the Hugging Face Hub, offline and small.

sentence-transformers' training examples download a model and a dataset; this machine has no hub. Each script here
imports ``load_dataset`` and ``model_path`` from this file instead: ``load_dataset`` returns a few dozen rows in
memory (``datasets.Dataset.from_dict``) with the columns of the hub dataset it stands in for, and ``model_path``
returns stnb's tiny random BERT (2 layers, hidden 64, MiniLM's tokenizer) for any model name.
"""

from __future__ import annotations

SUBJECTS = ["the cat", "a rocket", "the baker", "the river", "a chess player", "the violinist", "a glacier",
            "the bee", "a lighthouse", "the gardener", "an old train", "the storm"]
DOINGS = [("sleeps in the sun", "naps in warm light", "runs through the rain"),
          ("climbs into orbit", "rises toward space", "rests on the launch pad"),
          ("bakes fresh bread", "makes a warm loaf", "sells old shoes"),
          ("cuts a deep valley", "carves the land", "freezes every night"),
          ("plans ten moves ahead", "thinks about the endgame", "throws the board away")]


def _sentence(i: int, which: int = 0) -> str:
    subject, doing = SUBJECTS[i % len(SUBJECTS)], DOINGS[(i // len(SUBJECTS)) % len(DOINGS)]
    return f"{subject} {doing[which]}"


def _rows(split: str, n: int) -> range:
    """Distinct row numbers per split: the dev and test rows are not trained on."""
    start = {"train": 0, "validation": 40, "dev": 40, "test": 50}[split]
    return range(start, start + n)


def load_dataset(path: str, name: str | None = None, split: str = "train"):
    """A small in-memory stand-in for ``datasets.load_dataset(path, name, split=split)``."""
    from datasets import Dataset

    n = 40 if split == "train" else 10
    rows = _rows(split, n)
    if path == "sentence-transformers/stsb" or (path == "sentence-transformers/all-nli" and name == "pair-score"):
        return Dataset.from_dict({"sentence1": [_sentence(i) for i in rows],
                                  "sentence2": [_sentence(i + (i % 3 == 2), 1 + (i % 3 == 1)) for i in rows],
                                  "score": [(1.0, 0.2, 0.0)[i % 3] for i in rows]})
    if path == "sentence-transformers/all-nli" and name == "triplet":
        return Dataset.from_dict({"anchor": [_sentence(i) for i in rows], "positive": [_sentence(i, 1) for i in rows],
                                  "negative": [_sentence(i, 2) for i in rows]})
    if path == "sentence-transformers/wikipedia-en-sentences":
        return Dataset.from_dict({"sentence": [f"{_sentence(i, 1)}, as the article says" for i in rows]})
    if path == "sentence-transformers/gooaq":
        return Dataset.from_dict({"question": [f"why {_sentence(i)}?" for i in rows],
                                  "answer": [_sentence(i, 1) for i in rows]})
    if path == "sentence-transformers/natural-questions":
        return Dataset.from_dict({"query": [f"who {_sentence(i, 1)}" for i in rows],
                                  "answer": [_sentence(i) for i in rows]})
    raise ValueError(f"no offline stand-in for {path!r} ({name!r}); add one to {__file__}")


def model_path(name: str) -> str:
    """stnb's tiny random BERT, whatever model ``name`` the original script loads from the hub."""
    from stnb.models import tiny_path

    return tiny_path()
