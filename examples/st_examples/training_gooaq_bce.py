"""sentence-transformers' examples/cross_encoder/training/rerankers/training_gooaq_bce.py, offline and small.

Trains a reranker (a CrossEncoder with one output) on GooAQ question-answer pairs with binary cross-entropy, each
question's hard negatives mined with an embedding model (``mine_hard_negatives``, "labeled-pair" output), evaluated
by reranking each dev question's mined candidates (CrossEncoderRerankingEvaluator); the best checkpoint by its
NDCG@10 is loaded at the end. Changed to run offline and small, and nothing else: the reranker and the embedding
model are the tiny random BERT (``offline_hub``; ModernBERT-base and static-retrieval-mrl-en-v1 in the original),
40 question-answer pairs shaped like sentence-transformers/gooaq (8 held out) instead of 100,000, 2 hard negatives
instead of 5 and 6 candidates to rerank instead of 30, mined without faiss (not installed), no NanoBEIR evaluator
(it downloads its datasets), no model card data, 6 steps (``max_steps``) instead of one epoch, a batch of 4 instead
of 64, no dataloader workers, evaluation and checkpoints every 2 steps instead of 1000, and ``use_cpu=True`` beside
``bf16=True`` (transformers refuses bf16 without a GPU otherwise); the script's end (the final evaluation, the save,
the hub upload) is left to the caller: ``build()`` returns the trainer for ``stnb.run(build, strategy=...)``.

    python examples/st_examples/training_gooaq_bce.py fsdp      # 2 ranks under stnb
"""

import torch

from sentence_transformers import SentenceTransformer
from sentence_transformers.cross_encoder import CrossEncoder
from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator
from sentence_transformers.cross_encoder.losses.BinaryCrossEntropyLoss import BinaryCrossEntropyLoss
from sentence_transformers.cross_encoder.trainer import CrossEncoderTrainer
from sentence_transformers.cross_encoder.training_args import CrossEncoderTrainingArguments
from sentence_transformers.evaluation.SequentialEvaluator import SequentialEvaluator
from sentence_transformers.util import mine_hard_negatives

from offline_hub import load_dataset, model_path  # offline: instead of the hub's


def build(output_dir: str = "models/reranker-ModernBERT-base-gooaq-bce"):
    model_name = "answerdotai/ModernBERT-base"
    train_batch_size = 4  # small: 64 in the original
    num_hard_negatives = 2  # small: 5 in the original

    # 1. The model to finetune (offline: the tiny random BERT with a one-output head)
    model = CrossEncoder(model_path(model_name), num_labels=1)

    # 2a. The GooAQ dataset (offline: a small stand-in with its columns question, answer)
    full_dataset = load_dataset("sentence-transformers/gooaq", split="train")
    dataset_dict = full_dataset.train_test_split(test_size=8, seed=12)
    train_dataset = dataset_dict["train"]
    eval_dataset = dataset_dict["test"]

    # 2b. Hard negatives for the training pairs, mined with an embedding model
    embedding_model = SentenceTransformer(model_path("sentence-transformers/static-retrieval-mrl-en-v1"), device="cpu")
    hard_train_dataset = mine_hard_negatives(
        train_dataset,
        embedding_model,
        num_negatives=num_hard_negatives,
        margin=0,
        range_min=0,
        range_max=10,  # small: 100 in the original
        sampling_strategy="top",
        batch_size=64,
        output_format="labeled-pair",  # (question, answer, label), as BinaryCrossEntropyLoss reads
        use_faiss=False,  # offline and small: faiss is not installed
        verbose=False,
    )

    # 3. The training loss, positives weighted by the number of negatives
    loss = BinaryCrossEntropyLoss(model=model, pos_weight=torch.tensor(num_hard_negatives))

    # 4. A reranking evaluator on each dev question's mined candidates (the positive among them)
    hard_eval_dataset = mine_hard_negatives(
        eval_dataset,
        embedding_model,
        corpus=list(full_dataset["answer"]),  # changed: datasets 5 returns a Column, which mining cannot add to
        num_negatives=6,  # small: 30 in the original
        batch_size=64,
        include_positives=True,
        output_format="n-tuple",
        use_faiss=False,
        verbose=False,
    )
    reranking_evaluator = CrossEncoderRerankingEvaluator(
        samples=[
            {
                "query": sample["question"],
                "positive": [sample["answer"]],
                "documents": [sample[column_name] for column_name in hard_eval_dataset.column_names[2:]],
            }
            for sample in hard_eval_dataset
        ],
        batch_size=train_batch_size,
        name="gooaq-dev",
        always_rerank_positives=False,
    )
    evaluator = SequentialEvaluator([reranking_evaluator])  # offline: without the NanoBEIR evaluator

    # 5. The training arguments (small: max_steps=6 instead of num_train_epochs=1, every 1000 steps -> every 2)
    run_name = "reranker-ModernBERT-base-gooaq-bce"
    args = CrossEncoderTrainingArguments(
        output_dir=output_dir,
        max_steps=6,
        per_device_train_batch_size=train_batch_size,
        per_device_eval_batch_size=train_batch_size,
        learning_rate=2e-5,
        warmup_ratio=0.1,
        fp16=False,
        bf16=True,  # as in the original
        use_cpu=not torch.cuda.is_available(),  # on CPU, transformers accepts bf16 only with use_cpu=True
        dataloader_num_workers=0,  # small: 4 in the original
        load_best_model_at_end=True,
        metric_for_best_model="eval_gooaq-dev_ndcg@10",
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        logging_steps=2,
        logging_first_step=True,
        run_name=run_name,
        seed=12,
        report_to="none",  # offline: no W&B
    )

    # 6. The trainer (stnb starts the training)
    return CrossEncoderTrainer(
        model=model,
        args=args,
        train_dataset=hard_train_dataset,
        loss=loss,
        evaluator=evaluator,
    )


if __name__ == "__main__":
    import sys

    import stnb

    strategy = sys.argv[1] if len(sys.argv) > 1 else "ddp"
    result = stnb.run(build, strategy=strategy, num_processes=None if strategy == "single" else 2)
    print(result.verified, result.dev_metric_before, "->", result.dev_metric_after)
