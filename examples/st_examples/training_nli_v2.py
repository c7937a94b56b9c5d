"""sentence-transformers' examples/sentence_transformer/training/nli/training_nli_v2.py, offline and small.

Trains a model on AllNLI triplets (anchor, entailment as positive, contradiction as hard negative) with
MultipleNegativesRankingLoss and the NO_DUPLICATES batch sampler, evaluated on the STS benchmark's dev split.
Changed to run offline and small, and nothing else: the model and the datasets come from ``offline_hub`` (the tiny
random BERT; 40 triplets shaped like sentence-transformers/all-nli's "triplet" subset), 6 steps (``max_steps``)
instead of one epoch, a batch of 4 instead of 128, evaluation and checkpoints every 2 steps instead of 10; the
script's end (the test evaluation, the save, the hub upload) is left to the caller: ``build()`` returns the trainer
for ``stnb.run(build, strategy=...)``.

    python examples/st_examples/training_nli_v2.py fsdp      # 2 ranks under stnb
"""

from sentence_transformers import SentenceTransformer, losses
from sentence_transformers.evaluation import EmbeddingSimilarityEvaluator
from sentence_transformers.similarity_functions import SimilarityFunction
from sentence_transformers.trainer import SentenceTransformerTrainer
from sentence_transformers.training_args import BatchSamplers, SentenceTransformerTrainingArguments

from offline_hub import load_dataset, model_path  # offline: instead of the hub's


def build(output_dir: str = "output/training_nli_v2"):
    model_name = "distilroberta-base"
    train_batch_size = 4  # small: 128 in the original

    # 1. The model (offline: the tiny random BERT, with mean pooling)
    model = SentenceTransformer(model_path(model_name))

    # 2. The AllNLI triplets (offline: a small stand-in with its columns anchor, positive, negative)
    train_dataset = load_dataset("sentence-transformers/all-nli", "triplet", split="train")
    eval_dataset = load_dataset("sentence-transformers/all-nli", "triplet", split="dev")

    # 3. The training loss: in-batch negatives, and each triplet's contradiction as a hard negative
    train_loss = losses.MultipleNegativesRankingLoss(model)

    # 4. An evaluator on the STS benchmark's dev split
    stsb_eval_dataset = load_dataset("sentence-transformers/stsb", split="validation")
    dev_evaluator = EmbeddingSimilarityEvaluator(
        sentences1=stsb_eval_dataset["sentence1"],
        sentences2=stsb_eval_dataset["sentence2"],
        scores=stsb_eval_dataset["score"],
        main_similarity=SimilarityFunction.COSINE,
        name="sts-dev",
    )

    # 5. The training arguments (small: max_steps=6 instead of num_train_epochs=1, every 10 steps -> every 2)
    args = SentenceTransformerTrainingArguments(
        output_dir=output_dir,
        max_steps=6,
        per_device_train_batch_size=train_batch_size,
        per_device_eval_batch_size=train_batch_size,
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
        run_name="nli-v2",
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
