"""sentence-transformers' examples/sentence_transformer/training/matryoshka/matryoshka_nli.py, offline and small.

Trains a model on AllNLI triplets with MatryoshkaLoss around MultipleNegativesRankingLoss, so that the embedding
truncated to each of ``matryoshka_dims`` works on its own; evaluated on the STS benchmark's dev split at every
dimension (a SequentialEvaluator whose main score is the full dimension's). Changed to run offline and small, and
nothing else: the model and the datasets come from ``offline_hub`` (the tiny random BERT, 64 dimensions, so the
dimensions are [64, 32, 16] instead of [768, 512, 256, 128, 64]; 40 triplets shaped like
sentence-transformers/all-nli), 6 steps (``max_steps``) instead of one epoch, a batch of 4 instead of 128,
evaluation and checkpoints every 2 steps instead of 100; the script's end (the test evaluation, the save, the hub
upload) is left to the caller: ``build()`` returns the trainer for ``stnb.run(build, strategy=...)``.

    python examples/st_examples/matryoshka_nli.py zero2      # 2 ranks under stnb
"""

from sentence_transformers import (
    SentenceTransformer,
    SentenceTransformerTrainer,
    SentenceTransformerTrainingArguments,
    losses,
)
from sentence_transformers.evaluation import EmbeddingSimilarityEvaluator, SequentialEvaluator, SimilarityFunction
from sentence_transformers.training_args import BatchSamplers

from offline_hub import load_dataset, model_path  # offline: instead of the hub's


def build(output_dir: str = "output/matryoshka_nli"):
    model_name = "distilroberta-base"
    batch_size = 4  # small: 128 in the original
    matryoshka_dims = [64, 32, 16]  # the tiny model's 64 dimensions and two truncations

    # 1. The model (offline: the tiny random BERT, with mean pooling)
    model = SentenceTransformer(model_path(model_name))

    # 2. The AllNLI triplets (offline: a small stand-in with its columns anchor, positive, negative)
    train_dataset = load_dataset("sentence-transformers/all-nli", "triplet", split="train")
    eval_dataset = load_dataset("sentence-transformers/all-nli", "triplet", split="dev")

    # 3. The training loss: MNRL at every Matryoshka dimension
    inner_train_loss = losses.MultipleNegativesRankingLoss(model)
    train_loss = losses.MatryoshkaLoss(model, inner_train_loss, matryoshka_dims=matryoshka_dims)

    # 4. An evaluator on the STS benchmark's dev split at every dimension
    stsb_eval_dataset = load_dataset("sentence-transformers/stsb", split="validation")
    evaluators = []
    for dim in matryoshka_dims:
        evaluators.append(
            EmbeddingSimilarityEvaluator(
                sentences1=stsb_eval_dataset["sentence1"],
                sentences2=stsb_eval_dataset["sentence2"],
                scores=stsb_eval_dataset["score"],
                main_similarity=SimilarityFunction.COSINE,
                name=f"sts-dev-{dim}",
                truncate_dim=dim,
            )
        )
    dev_evaluator = SequentialEvaluator(evaluators, main_score_function=lambda scores: scores[0])

    # 5. The training arguments (small: max_steps=6 instead of num_train_epochs=1, every 100 steps -> every 2)
    args = SentenceTransformerTrainingArguments(
        output_dir=output_dir,
        max_steps=6,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        warmup_ratio=0.1,
        fp16=True,  # as in the original (on CPU the trainer computes in float32)
        bf16=False,
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        logging_steps=2,
        run_name="matryoshka-nli",
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
