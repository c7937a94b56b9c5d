"""The sentence-transformers model types stnb trains, in one place: which trainer goes with which model,
how to load a saved one again, and what to compare when checking a reload.

=================  ========================  ==============================  ===================
kind               model                     trainer                         probe (a reload is
                                                                                  checked with)
=================  ========================  ==============================  ===================
bi-encoder         SentenceTransformer       SentenceTransformerTrainer      ``encode``
reranker           CrossEncoder              CrossEncoderTrainer             ``predict`` (scores)
sparse             SparseEncoder             SparseEncoderTrainer            ``encode`` (dense view)
multi-vector       MultiVectorEncoder        MultiVectorEncoderTrainer       ``encode`` (token vectors)
=================  ========================  ==============================  ===================

All four share sentence-transformers 6's ``BaseModel`` and ``BaseTrainer``; stnb applies a strategy to any
of them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE = ["a quick check that the saved model encodes", "and a second text"]


@dataclass(frozen=True)
class ModelType:
    kind: str
    model: str     # class name, in sentence_transformers
    trainer: str
    example: str   # how such a build function ends


TYPES = (
    ModelType("bi-encoder", "SentenceTransformer", "SentenceTransformerTrainer",
              "return SentenceTransformerTrainer(model=model, args=args, train_dataset=..., loss=...)"),
    ModelType("reranker", "CrossEncoder", "CrossEncoderTrainer",
              "return CrossEncoderTrainer(model=model, args=args, train_dataset=..., loss=BinaryCrossEntropyLoss(model))"),
    ModelType("sparse", "SparseEncoder", "SparseEncoderTrainer",
              "return SparseEncoderTrainer(model=model, args=args, train_dataset=..., loss=SpladeLoss(model, ...))"),
    ModelType("multi-vector", "MultiVectorEncoder", "MultiVectorEncoderTrainer",
              "return MultiVectorEncoderTrainer(model=model, args=args, train_dataset=..., loss=...)"),
)


def _classes(name: str):
    import sentence_transformers as st

    return getattr(st, name)


def of_trainer(trainer) -> ModelType | None:
    """The model type whose trainer ``trainer`` is (a subclass counts), else None."""
    for t in TYPES:
        if isinstance(trainer, _classes(t.trainer)):
            return t
    return None


def of_model(model) -> ModelType | None:
    for t in TYPES:
        if isinstance(model, _classes(t.model)):
            return t
    return None


def known_trainers() -> str:
    return ", ".join(t.trainer for t in TYPES)


def trainer_problem(objects: dict) -> str:
    """Before any process starts: a build function that reads a trainer class stnb does not train (and none it
    does) is refused naming the ones it knows. ``objects``: the globals the function reads."""
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover
        return ""
    classes = [o for o in objects.values() if isinstance(o, type) and issubclass(o, Trainer)]
    known = tuple(_classes(t.trainer) for t in TYPES)
    if not classes or any(issubclass(c, known) for c in classes):
        return ""
    names = ", ".join(sorted(c.__name__ for c in classes))
    return (f"your build function uses {names}, and stnb trains the sentence-transformers trainers "
            f"{known_trainers()} (bi-encoders, rerankers, sparse and multi-vector encoders); end it with "
            + " or ".join(f"`return {t.trainer}(...)`" for t in TYPES))


def load_like(model, path: str, device: str = "cpu", max_seq_length: int | None = None):
    """Load the model saved at ``path`` as the same class as ``model`` (a CrossEncoder as a CrossEncoder)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    if issubclass(cls, FSDPModule):  # fully_shard made a subclass of the model's own class
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    loaded = cls(path, device=device)
    if max_seq_length is not None:
        loaded.max_seq_length = max_seq_length
    return loaded


def probe(model):
    """What the model outputs for a fixed input, as one numpy array (to compare a reload with the original)."""
    import numpy as np

    kind = of_model(model)
    if kind is not None and kind.kind == "reranker":
        return np.asarray(model.predict([PROBE], convert_to_numpy=True), dtype=np.float32)
    out = model.encode(PROBE, convert_to_tensor=True) if kind is not None and kind.kind == "sparse" else model.encode(PROBE)
    if hasattr(out, "to_dense"):
        out = out.to_dense().cpu().numpy()
    if isinstance(out, list):  # multi-vector: one array of token vectors per text
        out = np.concatenate([np.asarray(o.cpu() if hasattr(o, "cpu") else o).reshape(-1) for o in out])
    return np.asarray(out, dtype=np.float32)
