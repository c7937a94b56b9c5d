"""sentence-transformers' examples/sentence_transformer/training/distillation/model_distillation.py, offline and small.

Distills a teacher into a student: the teacher's embeddings of every training sentence become the dataset's
``label`` column, and the student learns to imitate them with EmbedDistillLoss (cosine distance). The teacher's
dimension differs from the student's, so the loss carries a learnable projection (an ``nn.Linear`` from the
student's dimension to the teacher's) that trains with the student: a loss with its own trainable parameters.
The best checkpoint by the STS dev metric is loaded at the end. Changed to run offline and small, and nothing
else: the teacher is the tiny random BERT with a Dense layer to 96 dimensions (the original's teacher,
stsb-roberta-base-v2, has 768, its TinyBERT student 312) and the student the tiny random BERT (64), the sentences
a small stand-in for AllNLI's and Wikipedia's (no cache on disk), 6 steps (``max_steps``) instead of one epoch, a
batch of 4 instead of 64, evaluation and checkpoints every 2 steps instead of 500; the script's end (the test
evaluation, the save, the hub upload) is left to the caller: ``build()`` returns the trainer for
``stnb.run(build, strategy=...)``.

    python examples/st_examples/model_distillation.py ddp      # 2 ranks under stnb
"""

import pandas as pd
from datasets import Dataset, concatenate_datasets

from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator
from sentence_transformers.sentence_transformer.losses import EmbedDistillLoss
from sentence_transformers.sentence_transformer.trainer import SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments
from sentence_transformers.util.similarity import SimilarityFunction

from offline_hub import load_dataset, model_path  # offline: instead of the hub's


def teacher(name: str) -> SentenceTransformer:
    """Offline: a teacher wider than the student (the tiny BERT, mean pooling, a Dense layer to 96 dimensions)."""
    from sentence_transformers.sentence_transformer.modules import Dense

    base = SentenceTransformer(model_path(name))
    return SentenceTransformer(modules=[*base, Dense(base.get_embedding_dimension(), 96)])


def combine_sentences(batch):
    return {"sentence": batch["sentence1"] + batch["sentence2"]}


def deduplicate(dataset):
    df = pd.DataFrame(dataset)
    df = df.drop_duplicates()
    return Dataset.from_pandas(df, preserve_index=False)


def build(output_dir: str = "output/model-distillation"):
    # The teacher, and the student that imitates it
    teacher_model = teacher("sentence-transformers/stsb-roberta-base-v2")
    student_model = SentenceTransformer(model_path("nreimers/TinyBERT_L-4_H-312_v2"))
    inference_batch_size = 16
    train_batch_size = 4  # small: 64 in the original

    # AllNLI's sentences (each pair's two, deduplicated) and Wikipedia's (offline: small stand-ins)
    nli_train_dataset = load_dataset("sentence-transformers/all-nli", "pair-score", split="train")
    nli_eval_dataset = load_dataset("sentence-transformers/all-nli", "pair-score", split="dev")
    nli_train_dataset = nli_train_dataset.map(
        combine_sentences, batched=True, remove_columns=nli_train_dataset.column_names
    )
    nli_eval_dataset = nli_eval_dataset.map(
        combine_sentences, batched=True, remove_columns=nli_eval_dataset.column_names
    )
    nli_train_dataset = deduplicate(nli_train_dataset)
    nli_eval_dataset = deduplicate(nli_eval_dataset)
    stsb_eval_dataset = load_dataset("sentence-transformers/stsb", split="validation")
    wikipedia_train_dataset = load_dataset("sentence-transformers/wikipedia-en-sentences", split="train")
    wikipedia_train_dataset_dict = wikipedia_train_dataset.train_test_split(test_size=5, seed=12)
    wikipedia_train_dataset = wikipedia_train_dataset_dict["train"]
    wikipedia_eval_dataset = wikipedia_train_dataset_dict["test"]

    # Changed: pandas 3 turns the deduplicated column into large_string, which concatenate_datasets (datasets 5)
    # refuses beside Wikipedia's string column ("The features can't be aligned"): cast to the same type
    wikipedia_train_dataset = wikipedia_train_dataset.cast(nli_train_dataset.features)
    wikipedia_eval_dataset = wikipedia_eval_dataset.cast(nli_eval_dataset.features)
    train_dataset = concatenate_datasets([nli_train_dataset, wikipedia_train_dataset])
    eval_dataset = concatenate_datasets([nli_eval_dataset.select(range(5)), wikipedia_eval_dataset])

    # An STSB evaluator
    dev_evaluator = EmbeddingSimilarityEvaluator(
        sentences1=stsb_eval_dataset["sentence1"],
        sentences2=stsb_eval_dataset["sentence2"],
        scores=stsb_eval_dataset["score"],
        main_similarity=SimilarityFunction.COSINE,
        name="sts-dev",
    )

    # The teacher's embeddings of every sentence, as the label
    def map_embeddings(batch):
        return {
            "label": teacher_model.encode(
                batch["sentence"], batch_size=inference_batch_size, show_progress_bar=False
            ).tolist()
        }

    train_dataset = train_dataset.map(map_embeddings, batched=True, batch_size=50000)
    eval_dataset = eval_dataset.map(map_embeddings, batched=True, batch_size=50000)

    # The dimensions differ (64 and 96): the loss carries a learnable projection into the teacher's space
    student_dim = student_model.get_embedding_dimension()
    teacher_dim = teacher_model.get_embedding_dimension()
    projection_dim = teacher_dim if student_dim != teacher_dim else None
    train_loss = EmbedDistillLoss(
        model=student_model,
        distance_metric="cosine",
        projection_dim=projection_dim,
    )

    # The training arguments (small: max_steps=6 instead of num_train_epochs=1, every 500 steps -> every 2)
    args = SentenceTransformerTrainingArguments(
        output_dir=output_dir,
        max_steps=6,
        per_device_train_batch_size=train_batch_size,
        per_device_eval_batch_size=train_batch_size,
        warmup_steps=0.1,
        fp16=True,  # as in the original (on CPU the trainer computes in float32)
        bf16=False,
        metric_for_best_model="eval_sts-dev_spearman_cosine",
        load_best_model_at_end=True,
        learning_rate=1e-4,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        logging_steps=2,
        run_name="distillation-tinybert",
        report_to="none",  # offline: no W&B
    )

    # The trainer (stnb starts the training)
    return SentenceTransformerTrainer(
        model=student_model,
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
