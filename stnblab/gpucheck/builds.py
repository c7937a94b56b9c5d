"""The gpu-check's CrossEncoder and SparseEncoder rows: build functions for ``stnb.run(build, ...)``
(sentence-transformers' own trainers), on the row's model, batch, steps and precision, with a dev
evaluator before and after, as a user's notebook would write them."""

from __future__ import annotations


def _words(i: int) -> str:
    return f"item {i} number {i * 7 % 13} colour {('red', 'green', 'blue', 'grey')[i % 4]}"


def _args(out: str, p: dict) -> dict:
    mp = p.get("mixed_precision", "no")
    return dict(output_dir=out, per_device_train_batch_size=p["per_device_batch_size"], max_steps=p["steps"],
                learning_rate=1e-4, logging_steps=1, report_to="none", save_strategy="no", seed=7,
                bf16=mp == "bf16", fp16=mp == "fp16")


def reranker(out: str, model_path: str, p: dict):
    """A CrossEncoder: (query, passage, label) rows, a positive and a hard negative per query (BCE)."""
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    model = CrossEncoder(model_path, num_labels=1, max_length=p["max_seq_length"])
    n = max(16, p["per_device_batch_size"] * 2)
    rows = {"query": [], "passage": [], "label": []}
    for i in range(n):
        for passage, label in ((_words(i), 1.0), (_words(i + 1), 0.0)):
            rows["query"].append(f"what about {_words(i)}")
            rows["passage"].append(passage)
            rows["label"].append(label)
    dev = CrossEncoderRerankingEvaluator(
        [{"query": f"what about {_words(i)}", "positive": [_words(i)], "negative": [_words(i + 1), _words(i + 2)]}
         for i in range(8)], name="dev", write_csv=False)
    return CrossEncoderTrainer(model=model, args=CrossEncoderTrainingArguments(**_args(out, p)),
                               train_dataset=Dataset.from_dict(rows), loss=BinaryCrossEntropyLoss(model), evaluator=dev)


def sparse(out: str, model_path: str, p: dict):
    """A SPLADE SparseEncoder (MLM head + max pooling) with SpladeLoss over in-batch negatives."""
    from datasets import Dataset
    from sentence_transformers.sparse_encoder import SparseEncoder, SparseEncoderTrainer, SparseEncoderTrainingArguments
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    model = SparseEncoder(modules=[MLMTransformer(model_path, max_seq_length=p["max_seq_length"]),
                                   SpladePooling(pooling_strategy="max")])
    n = max(32, p["per_device_batch_size"] * 2)
    data = Dataset.from_dict({"anchor": [f"what about {_words(i)}" for i in range(n)],
                              "positive": [_words(i) for i in range(n)]})
    loss = SpladeLoss(model, loss=SparseMultipleNegativesRankingLoss(model), query_regularizer_weight=5e-5,
                      document_regularizer_weight=3e-5)
    dev = SparseInformationRetrievalEvaluator(
        queries={f"q{i}": f"what about {_words(i)}" for i in range(8)},
        corpus={f"d{i}": _words(i) for i in range(16)}, relevant_docs={f"q{i}": {f"d{i}"} for i in range(8)},
        name="dev", write_csv=False)
    return SparseEncoderTrainer(model=model, args=SparseEncoderTrainingArguments(**_args(out, p)), train_dataset=data,
                                loss=loss, evaluator=dev)


BUILDS = {"reranker": reranker, "sparse": sparse}
