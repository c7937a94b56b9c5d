"""sentence-transformers' examples/sparse_encoder/training/retrievers/train_splade_nq.py, offline and small.

Trains a SPLADE retriever (a SparseEncoder: an MLM head's logits max-pooled into a vocabulary-sized sparse vector)
on Natural Questions with SpladeLoss around SparseMultipleNegativesRankingLoss, FLOPS regularizers on the queries
and the documents keeping the vectors sparse; the best checkpoint by the evaluator's NDCG@10 is loaded at the end.
Changed to run offline and small, and nothing else: the model is the tiny random BERT (``offline_hub``; DistilBERT
in the original), 40 query-answer pairs shaped like sentence-transformers/natural-questions (8 held out) instead of
100,000, a SparseInformationRetrievalEvaluator on the held-out pairs instead of SparseNanoBEIREvaluator (it
downloads its datasets), no model card data, 6 steps (``max_steps``) instead of one epoch, a batch of 4 instead of
12, evaluation and checkpoints every 2 steps instead of 1650, and ``use_cpu=True`` beside ``bf16=True``
(transformers refuses bf16 without a GPU otherwise); the script's end (the final evaluation, the save, the hub
upload) is left to the caller: ``build()`` returns the trainer for ``stnb.run(build, strategy=...)``.

    python examples/st_examples/train_splade_nq.py zero1      # 2 ranks under stnb
"""

import torch

from sentence_transformers import (
    SparseEncoder,
    SparseEncoderTrainer,
    SparseEncoderTrainingArguments,
)
from sentence_transformers.sparse_encoder import evaluation, losses
from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
from sentence_transformers.training_args import BatchSamplers

from offline_hub import load_dataset, model_path  # offline: instead of the hub's


def build(output_dir: str = "models/splade-distilbert-base-uncased-nq"):
    model_name = "distilbert/distilbert-base-uncased"
    train_batch_size = 4  # small: 12 in the original

    # 1. The model to finetune: what SparseEncoder(model_name) builds from a plain masked-language model, an MLM
    # head's logits max-pooled (offline: spelled out, because the tiny BERT's folder is a SentenceTransformer's,
    # which SparseEncoder would turn into a CSR model instead)
    model = SparseEncoder(
        modules=[MLMTransformer(model_path(model_name)), SpladePooling(pooling_strategy="max")],
        similarity_fn_name="dot",
    )
    model.max_seq_length = 256

    # 2. The NQ dataset (offline: a small stand-in with its columns query, answer)
    full_dataset = load_dataset("sentence-transformers/natural-questions", split="train")
    dataset_dict = full_dataset.train_test_split(test_size=8, seed=12)
    train_dataset = dataset_dict["train"]
    eval_dataset = dataset_dict["test"]

    # 3. The training loss: in-batch negatives, with FLOPS regularizers on queries and documents
    query_regularizer_weight = 5e-5
    document_regularizer_weight = 3e-5
    loss = losses.SpladeLoss(
        model=model,
        loss=losses.SparseMultipleNegativesRankingLoss(model=model),
        query_regularizer_weight=query_regularizer_weight,
        document_regularizer_weight=document_regularizer_weight,
    )

    # 4. The evaluator (offline: retrieval of the held-out pairs' answers, instead of NanoBEIR's datasets)
    answers = list(full_dataset["answer"])
    evaluator = evaluation.SparseInformationRetrievalEvaluator(
        queries={str(i): row["query"] for i, row in enumerate(eval_dataset)},
        corpus={str(i): answer for i, answer in enumerate(answers)},
        relevant_docs={str(i): {str(answers.index(row["answer"]))} for i, row in enumerate(eval_dataset)},
        name="nq-dev",
        show_progress_bar=False,
        batch_size=train_batch_size,
    )

    # 5. The training arguments (small: max_steps=6 instead of num_train_epochs=1, every 1650 steps -> every 2)
    run_name = "splade-distilbert-base-uncased-nq"
    training_args = SparseEncoderTrainingArguments(
        output_dir=output_dir,
        max_steps=6,
        per_device_train_batch_size=train_batch_size,
        per_device_eval_batch_size=train_batch_size,
        learning_rate=2e-5,
        fp16=False,
        bf16=True,  # as in the original
        use_cpu=not torch.cuda.is_available(),  # on CPU, transformers accepts bf16 only with use_cpu=True
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        load_best_model_at_end=True,
        metric_for_best_model="eval_nq-dev_dot_ndcg@10",  # NanoBEIR's mean in the original
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        logging_steps=2,
        run_name=run_name,
        seed=42,
        report_to="none",  # offline: no W&B
    )

    # 6. The trainer (stnb starts the training)
    return SparseEncoderTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        loss=loss,
        evaluator=evaluator,
    )


if __name__ == "__main__":
    import sys

    import stnb

    strategy = sys.argv[1] if len(sys.argv) > 1 else "ddp"
    result = stnb.run(build, strategy=strategy, num_processes=None if strategy == "single" else 2)
    print(result.verified, result.dev_metric_before, "->", result.dev_metric_after)
