"""sentence-transformers' examples/sentence_transformer/training/sts/training_stsbenchmark.py, offline and small.

Trains a model on the STS benchmark with CosineSimilarityLoss, evaluated on its dev split with
EmbeddingSimilarityEvaluator. Changed to run offline and small, and nothing else: the model and the datasets come
from ``offline_hub`` (the tiny random BERT; 40 training pairs shaped like sentence-transformers/stsb), 6 steps
(``max_steps``) instead of 4 epochs, a batch of 4, evaluation and checkpoints every 2 steps instead of 100; the
script's end (the test evaluation, the save, the hub upload) is left to the caller: ``build()`` returns the trainer
for ``stnb.run(build, strategy=...)``.

    python examples/st_examples/training_stsbenchmark.py ddp      # 2 ranks under stnb
"""

from sentence_transformers import SentenceTransformer, losses
from sentence_transformers.evaluation import EmbeddingSimilarityEvaluator
from sentence_transformers.similarity_functions import SimilarityFunction
from sentence_transformers.trainer import SentenceTransformerTrainer
from sentence_transformers.training_args import SentenceTransformerTrainingArguments

from offline_hub import load_dataset, model_path  # offline: instead of the hub's


def build(output_dir: str = "output/training_stsbenchmark"):
    model_name = "distilbert-base-uncased"
    train_batch_size = 4  # small: 16 in the original

    # 1. The model (offline: the tiny random BERT, with mean pooling as for any plain transformer)
    model = SentenceTransformer(model_path(model_name))

    # 2. The STSB dataset (offline: a small stand-in with its columns sentence1, sentence2, score)
    train_dataset = load_dataset("sentence-transformers/stsb", split="train")
    eval_dataset = load_dataset("sentence-transformers/stsb", split="validation")

    # 3. The training loss: two texts and a similarity score between 0 and 1
    train_loss = losses.CosineSimilarityLoss(model=model)

    # 4. An evaluator on the dev split, used during training
    dev_evaluator = EmbeddingSimilarityEvaluator(
        sentences1=eval_dataset["sentence1"],
        sentences2=eval_dataset["sentence2"],
        scores=eval_dataset["score"],
        main_similarity=SimilarityFunction.COSINE,
        name="sts-dev",
    )

    # 5. The training arguments (small: max_steps=6 instead of num_train_epochs=4, every 100 steps -> every 2)
    args = SentenceTransformerTrainingArguments(
        output_dir=output_dir,
        max_steps=6,
        per_device_train_batch_size=train_batch_size,
        per_device_eval_batch_size=train_batch_size,
        warmup_ratio=0.1,
        fp16=True,  # as in the original (on CPU the trainer computes in float32)
        bf16=False,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        logging_steps=2,
        run_name="sts",
        report_to="none",  # offline: no W&B
    )

    # 6. The trainer (stnb starts the training)
    return SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        loss=train_loss,
        evaluator=dev_evaluator,
    )


if __name__ == "__main__":
    import sys

    import stnb

    strategy = sys.argv[1] if len(sys.argv) > 1 else "ddp"
    result = stnb.run(build, strategy=strategy, num_processes=None if strategy == "single" else 2)
    print(result.verified, result.dev_metric_before, "->", result.dev_metric_after)
